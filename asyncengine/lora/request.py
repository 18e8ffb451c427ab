"""LoRARequest, at vLLM's import path (`vllm.lora.request`); defined with the resolver interface in the floor."""

from __future__ import annotations

from asyncengine.interfaces.lora_resolver import LoRARequest

__all__ = ["LoRARequest"]
