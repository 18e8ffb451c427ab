"""RankInfoExtension: passes the hook's check, is reached through the worker's RPC lookup, reports its rank.

The end-to-end test (a real TP=2 engine, one extension per worker process) is
tests/e2e/test_config_hooks_e2e.py in the asyncengine repository.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import ae_worker_extension_example
from ae_worker_extension_example import RankInfoExtension
from asyncengine.config.engine import EngineConfig
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.worker.extension import build_extension, rpc_method
from asyncengine.worker.worker import Worker

PATH = "ae_worker_extension_example:RankInfoExtension"


@pytest.fixture(autouse=True)
def worker_role(monkeypatch):
    # No engine runs in this test process, so it has no role; the plugin asks through plugins_api.
    monkeypatch.setattr(ae_worker_extension_example, "current_process_role", lambda: "worker rank 1")


def make_worker() -> Worker:
    """A worker of rank 1 of 2 with the extension built as the worker builds it (no device, no model)."""
    worker = Worker(EngineConfig(worker_extension_cls=PATH), None, CpuPlatform, rank=1, world_size=2)
    worker.extension = build_extension(worker, PATH)
    return worker


def test_the_worker_extension_cls_hook_accepts_it():
    from asyncengine.plugin_runtime.config_hooks import load_hook

    assert load_hook("worker_extension_cls", PATH) is RankInfoExtension


def test_rpc_finds_the_worker_first_then_the_extension():
    worker = make_worker()
    assert isinstance(worker.extension, RankInfoExtension)
    assert rpc_method(worker, "describe").__self__ is worker
    assert rpc_method(worker, "describe_rank").__self__ is worker.extension


def test_describe_rank_reads_the_worker_it_was_given(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    worker = make_worker()
    answer = rpc_method(worker, "describe_rank")()
    assert answer["rank"] == 1 and answer["world_size"] == 2 and answer["role"] == "worker rank 1"
    assert answer["parameter_bytes"] == 0  # no model loaded yet
    worker.model_runner = SimpleNamespace(model=torch.nn.Linear(4, 2))  # 8 + 2 float32 parameters
    assert rpc_method(worker, "describe_rank")()["parameter_bytes"] == 40
    assert rpc_method(worker, "num_calls")() == 2
    events = [json.loads(line)["event"] for line in record.read_text().splitlines()]
    assert events == ["init", "describe_rank", "describe_rank"]
