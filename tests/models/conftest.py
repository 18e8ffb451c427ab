"""Fixtures of the architecture tests (test_native_architectures.py, test_moe_architectures.py)."""

from __future__ import annotations

import pytest

from support.hf_reference import hf_greedy
from support.parity_runs import NUM_TOKENS


@pytest.fixture(scope="module")
def references(tiny_model):
    """`references(name, prompt)`: transformers' greedy decoding of `prompt` on tiny model `name`, computed once
    per (model, prompt) in a module."""
    cache = {}

    def get(name: str, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy(tiny_model(name).hf_model, prompt, NUM_TOKENS)
        return cache[key]

    return get
