"""Attention backends: how the attention layers attend over the paged KV cache (docs/reference.md).

`backend.py` is the interface, `registry.py` the registry a plugin fills (`register_attention_backend`),
`selector.py` the worker's choice per layer (the platform's `get_attn_backend_cls`, or the
`attention_backend` option), `torch_paged.py` and `triton_paged.py` the built-in backends (the CPU
platform chooses TORCH_PAGED, the CUDA platform TRITON_PAGED). Only those two import torch (and
triton), so the registry and the interface load in every process (the manifest, `plugins_api`) at no cost.
"""
