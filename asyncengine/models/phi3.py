"""Phi-3 (and Phi-3.5, Phi-4-mini): Mistral's shape (a sliding window on every layer when `sliding_window` is set)
with q/k/v and gate/up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`: loaded into the same fused
layers, split per shard), LongRoPE and partial rotary (`partial_rotary_factor`) from its rope parameters."""

from __future__ import annotations

from asyncengine.models.mistral import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    pass
