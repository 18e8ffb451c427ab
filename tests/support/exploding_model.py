"""A Llama that raises on its Nth forward pass: the engine's reaction to a worker that fails mid-run.

Used through `model_class_overrides={"LlamaForCausalLM": "support.exploding_model:ExplodingLlama"}`;
worker processes find it because the test puts tests/ on PYTHONPATH.
"""

from __future__ import annotations

import os

from asyncengine.models.llama import LlamaForCausalLM

EXPLODE_AT = int(os.environ.get("EXPLODING_LLAMA_STEP", "5"))


class ExplodingLlama(LlamaForCausalLM):
    forward_calls = 0

    def forward(self, *args, **kwargs):
        type(self).forward_calls += 1
        if type(self).forward_calls == EXPLODE_AT:
            raise RuntimeError(f"boom at forward pass {EXPLODE_AT}")
        return super().forward(*args, **kwargs)
