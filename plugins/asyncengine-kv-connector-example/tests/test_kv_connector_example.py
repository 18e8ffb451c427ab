"""ExampleDiskConnector: registered by the general plugin, its own layout, records of where each half ran,
and the module-path class (C6) that wins over the registry entry.

The end-to-end test (real multiprocess servers, the scheduler side in the engine core, the worker side in
the worker process, a consumer that computes no prefill for the saved prefix) is
tests/e2e/test_kv_connector_e2e.py in the asyncengine repository.
"""

from __future__ import annotations

import json

import pytest
import torch

import ae_kv_connector_example
from ae_kv_connector_example import connector as connector_module
from ae_kv_connector_example.via_module_path import ExampleDiskConnector as ViaModulePath
from asyncengine.kv_transfer.factory import connector_class
from asyncengine.plugins_api import (
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorRequest,
    KVConnectorRole,
    KVTransferConfig,
)

BLOCK = 4
TOKENS = list(range(30, 39))  # two full blocks and one token


@pytest.fixture
def role(monkeypatch):
    """Pretend to be the process each half runs in (no engine runs in this test process)."""
    current = {"role": "engine core"}
    monkeypatch.setattr(connector_module, "current_process_role", lambda: current["role"])
    return current


@pytest.fixture
def records(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv(connector_module.RECORD_ENV, str(path))
    return lambda: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def build(cls, path, side: KVConnectorRole, kv_role: str):
    config = KVTransferConfig(kv_connector="ExampleDiskConnector", kv_role=kv_role,
                              kv_connector_extra_config={"path": str(path)})
    context = KVConnectorContext(block_size=BLOCK, tensor_parallel_size=1, rank=0, architecture="LlamaForCausalLM",
                                 dtype="float32", model="tiny")
    return cls(config, side, context)


def view(block_ids=(), computed=0, scheduled=0) -> KVConnectorRequest:
    from asyncengine.engine_core.sequence import hash_block

    hashes, parent = [], None
    for start in range(0, len(TOKENS) - BLOCK + 1, BLOCK):
        parent = hash_block(parent, TOKENS[start:start + BLOCK])
        hashes.append(parent)
    return KVConnectorRequest(request_id="r", prompt_token_ids=TOKENS, block_hashes=hashes, block_ids=list(block_ids),
                              num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def test_register_fills_the_registry_lazily_and_idempotently(monkeypatch):
    # On a copy of the table: this test process may start engines later, whose child processes have no plugin.
    monkeypatch.setattr(KVConnectorFactory, "_entries", dict(KVConnectorFactory._entries))
    ae_kv_connector_example.register()
    ae_kv_connector_example.register()  # every process calls it once; twice is a no-op too
    entry = KVConnectorFactory.get(ae_kv_connector_example.CONNECTOR)
    assert entry.implementation == "ae_kv_connector_example.connector:ExampleDiskConnector"
    choice = connector_class(KVTransferConfig(kv_connector="ExampleDiskConnector"))
    assert choice.cls is connector_module.ExampleDiskConnector
    by_path = connector_class(KVTransferConfig(kv_connector="ExampleDiskConnector",
                                               kv_connector_module_path="ae_kv_connector_example.via_module_path"))
    assert by_path.cls is ViaModulePath
    assert by_path.origin.startswith("kv_connector_module_path 'ae_kv_connector_example.via_module_path'; it wins "
                                     "over the registry entry 'ExampleDiskConnector'")


def test_save_then_load_in_its_own_layout_recording_each_half(tmp_path, role, records):
    tmp_path = tmp_path / "store"
    caches = [(torch.randn(2, 5, BLOCK, 3), torch.randn(2, 5, BLOCK, 3)) for _ in range(2)]
    scheduler = build(connector_module.ExampleDiskConnector, tmp_path, KVConnectorRole.SCHEDULER, "producer")
    metadata = scheduler.build_connector_meta([view(block_ids=[1, 4, 2], scheduled=len(TOKENS))])
    role["role"] = "worker rank 0"
    worker = build(connector_module.ExampleDiskConnector, tmp_path, KVConnectorRole.WORKER, "producer")
    worker.register_kv_caches(caches)
    worker.wait_for_save(metadata)
    saved = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    keys = [h.hex() for h in view().block_hashes]
    assert saved == sorted([f"example-blocks/{k[:2]}/{k}.rank0-of-1.safetensors" for k in keys]
                           + ["example-blocks/identity.rank0-of-1.json"])

    role["role"] = "engine core"
    consumer = build(ViaModulePath, tmp_path, KVConnectorRole.SCHEDULER, "consumer")
    assert consumer.get_num_new_matched_tokens(view(), 0) == 8
    consumer.update_state_after_alloc(view(block_ids=[0, 3, 2]), 8)
    loads = consumer.build_connector_meta([view(block_ids=[0, 3, 2], computed=8, scheduled=1)])
    role["role"] = "worker rank 0"
    loader = build(ViaModulePath, tmp_path, KVConnectorRole.WORKER, "consumer")
    target = [(torch.zeros(2, 5, BLOCK, 3), torch.zeros(2, 5, BLOCK, 3)) for _ in range(2)]
    loader.register_kv_caches(target)
    loader.start_load_kv(loads)
    assert torch.equal(target[1][0][:, 3], caches[1][0][:, 4]) and torch.equal(target[0][1][:, 0], caches[0][1][:, 1])

    where = {(r["variant"], r["side"], r["event"]): r["role"] for r in records()}
    assert where == {
        ("registry", "scheduler", "init"): "engine core",
        ("registry", "scheduler", "build_connector_meta"): "engine core",
        ("registry", "worker", "init"): "worker rank 0",
        ("registry", "worker", "register_kv_caches"): "worker rank 0",
        ("registry", "worker", "wait_for_save"): "worker rank 0",
        ("module path", "scheduler", "init"): "engine core",
        ("module path", "scheduler", "get_num_new_matched_tokens"): "engine core",
        ("module path", "scheduler", "update_state_after_alloc"): "engine core",
        ("module path", "scheduler", "build_connector_meta"): "engine core",
        ("module path", "worker", "init"): "worker rank 0",
        ("module path", "worker", "register_kv_caches"): "worker rank 0",
        ("module path", "worker", "start_load_kv"): "worker rank 0",
    }
