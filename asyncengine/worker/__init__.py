"""The worker role: device, model, KV-cache memory, model runner and sampler."""
