"""The engine-core role: scheduler, KV-block bookkeeping and the step loop."""
