"""The fused_moe provider on plain tensors. (Its registration, in every process of an engine, is what the
end-to-end test tests/e2e/test_moe_plugin.py checks.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ae_moe_example
from ae_moe_example import CALLS, counting_fused_moe
from asyncengine.plugins_api import MoeConfig, fused_moe_reference


@pytest.fixture(autouse=True)
def fresh_count(monkeypatch):
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)
    monkeypatch.setitem(CALLS, "fused_moe", 0)


def _problem(tokens: int):
    generator = torch.Generator().manual_seed(tokens)
    return (torch.randn(tokens, 16, generator=generator), torch.randn(tokens, 4, generator=generator),
            torch.randn(4, 16, 16, generator=generator), torch.randn(4, 16, 8, generator=generator), None, None,
            MoeConfig(top_k=2, renormalize=True))


def test_the_provider_computes_the_reference_and_counts_its_calls():
    for tokens in (1, 7):
        args = _problem(tokens)
        assert torch.equal(counting_fused_moe(*args), fused_moe_reference(*args))
    assert CALLS["fused_moe"] == 2


def test_each_call_is_recorded_with_its_process(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    # No engine runs here, so there is no process role to read: stand in for the worker's.
    monkeypatch.setattr(ae_moe_example, "current_process_role", lambda: "worker rank 0")
    counting_fused_moe(*_problem(3))
    counting_fused_moe(*_problem(5))
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines == [{"what": "fused_moe", "call": n, "tokens": tokens, "pid": os.getpid(), "role": "worker rank 0"}
                     for n, tokens in ((1, 3), (2, 5))]

