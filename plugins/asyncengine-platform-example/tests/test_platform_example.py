"""The example platform's parts, in this process: activation, the Platform hooks, the CLI option, and its
attention backend against the built-in one (same cache, same metadata)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import ae_platform_example
from ae_platform_example.attention import ExampleSdpaBackend
from ae_platform_example.platform import CpuExamplePlatform
from asyncengine.attention.torch_paged import TorchPagedBackend
from asyncengine.config.engine import BUILTIN_WORKER, EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.models.layers.attention import AttentionMetadata
from asyncengine.ops.paged_attention import plan_attention
from asyncengine.plugin_runtime import platform_resolution as resolution


@pytest.fixture
def requested(monkeypatch):
    """Stand in for the platform phase's request (`--device`), and give this process a role."""
    monkeypatch.setattr("asyncengine.plugin_runtime.records._process_role", "frontend")

    def request(device: str | None) -> None:
        monkeypatch.setattr(resolution, "_requested", device)

    monkeypatch.delenv(ae_platform_example.ACTIVATE_ENV, raising=False)
    return request


def test_inactive_unless_named_or_switched_on(requested, monkeypatch):
    requested(None)
    assert ae_platform_example.detect() is None  # installed alone, it takes over no run
    requested("cpu")
    assert ae_platform_example.detect() is None
    requested("cpu_example")
    assert ae_platform_example.detect() == ae_platform_example.PLATFORM_CLASS
    requested(None)
    monkeypatch.setenv(ae_platform_example.ACTIVATE_ENV, "1")
    assert ae_platform_example.detect() == ae_platform_example.PLATFORM_CLASS


def test_the_class_passes_the_resolution_checks_and_names_itself_as_its_entry_point():
    resolution.check_platform(CpuExamplePlatform)  # raises naming a missing attribute or hook
    assert CpuExamplePlatform.device_name == "cpu_example" == ae_platform_example.DEVICE_NAME
    assert CpuExamplePlatform.device_type == "cpu" and CpuExamplePlatform.dist_backend == "gloo"
    assert CpuExamplePlatform.get_device_total_memory(None) > CpuExamplePlatform.get_current_memory_usage(None) > 0


def test_check_and_update_config_sets_its_worker_and_validates_its_option(requested, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    config = CpuExamplePlatform.check_and_update_config(EngineConfig(additional_config={"example_threads": 2}))
    assert config.worker_cls == ae_platform_example.WORKER_CLASS
    assert CpuExamplePlatform.check_and_update_config(EngineConfig(worker_cls=BUILTIN_WORKER)).worker_cls == BUILTIN_WORKER
    for bad in (0, -1, "2", True):
        with pytest.raises(ConfigError, match="example_threads.*positive integer") as caught:
            CpuExamplePlatform.check_and_update_config(EngineConfig(additional_config={"example_threads": bad}))
        assert caught.value.field == "additional_config"
    with pytest.raises(ConfigError, match="not dtype 'float16'"):
        CpuExamplePlatform.check_and_update_config(EngineConfig(dtype="float16"))
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(line["event"], line["role"], line["worker_cls"]) for line in lines] == [
        ("check_and_update_config", "frontend", ae_platform_example.WORKER_CLASS),
        ("check_and_update_config", "frontend", BUILTIN_WORKER)]


def test_the_cli_option_lands_in_additional_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--additional-config", dest="additional_config", type=json.loads, default=argparse.SUPPRESS)
    CpuExamplePlatform.pre_register_and_update(parser)
    assert vars(parser.parse_args([])) == {}
    assert parser.parse_args(["--example-threads", "3"]).additional_config == {"example_threads": 3}
    merged = parser.parse_args(["--additional-config", '{"other": 1}', "--example-threads", "2"])
    assert merged.additional_config == {"other": 1, "example_threads": 2}
    assert "--example-threads" in parser.format_help()


def test_the_attention_backend_matches_the_built_in_one():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 4, 12
    scale = dim ** -0.5
    # Three sequences: a whole prompt (7 tokens), a chunk after 5 cached tokens (3 new), a decode step
    # after 9 cached tokens; each on blocks of its own.
    query_lens, seq_lens = [7, 3, 1], [7, 8, 10]
    block_tables = torch.tensor([[0, 1, 0], [2, 3, 0], [4, 5, 6]])
    slots = []
    for table, query_len, seq_len in zip(block_tables.tolist(), query_lens, seq_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, dim, generator=gen)
    key, value = torch.randn(tokens, kv_heads, dim, generator=gen), torch.randn(tokens, kv_heads, dim, generator=gen)
    cached = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen)  # earlier tokens' keys and values
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), plan=plan_attention(query_lens, seq_lens,
                                 block_tables, block_size), query_lens=query_lens, seq_lens=seq_lens,
                                 block_tables=block_tables)
    outputs, caches = [], []
    for backend in (TorchPagedBackend(heads, kv_heads, dim, scale), ExampleSdpaBackend(heads, kv_heads, dim, scale)):
        cache = (cached[0].clone(), cached[1].clone())
        outputs.append(backend.forward(query, key, value, cache, metadata))
        caches.append(cache)
    assert outputs[1].shape == (tokens, heads, dim)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))  # the same slots written
