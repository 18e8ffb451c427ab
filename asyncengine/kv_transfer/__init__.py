"""KV connectors (docs/reference.md): supply a new request's KV blocks from outside the local
prefix cache, and save the KV a step computed. The scheduler side runs in the engine core, the worker
side in every worker rank (docs/kv_connectors.md)."""
