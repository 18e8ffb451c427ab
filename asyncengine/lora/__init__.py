"""Multi-LoRA serving (docs/lora.md): adapters in PEFT's format, applied per token in one batched step.

- `request`: LoRARequest, the name of one adapter a request runs with (the floor: it travels on the wire);
- `peft`: reading and checking an adapter directory (adapter_config.json, adapter_model.safetensors);
- `layers`: the LoRA-wrapped linear layers and their batched per-token operation;
- `pool`: the worker's fixed pool of adapter slots, filled from a CPU cache (least recently used out);
- `filesystem_resolver`: the built-in resolver, a directory with one adapter per sub-directory.
"""
