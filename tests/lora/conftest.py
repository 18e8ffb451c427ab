"""LoRA tests: adapters made with `peft` (a test-only package, installed into a temporary target on
sys.path, never into .venv) on the tiny random models, saved once per test module."""

from __future__ import annotations

import pytest

from support.lora_adapters import peft_module


@pytest.fixture(scope="session")
def peft(tmp_path_factory):
    return peft_module(tmp_path_factory)
