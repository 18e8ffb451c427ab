"""LocalDiskConnector on its own: both sides driven by hand, over small paged caches (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from asyncengine.engine_core.sequence import hash_block
from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.kv_connector import KVConnectorContext, KVConnectorRequest, KVConnectorRole
from asyncengine.config.kv_transfer import parse_kv_transfer_config
from asyncengine.kv_transfer.local_disk import BlockIO, LocalDiskConnector, LocalDiskMetadata

BLOCK = 4
SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def connector(path, role, side, *, rank=0, world=1, dtype="float32", connector_role="both") -> LocalDiskConnector:
    config = parse_kv_transfer_config({"kv_connector": "LocalDiskConnector", "kv_role": connector_role,
                                       "kv_connector_extra_config": {"path": str(path)}})
    context = KVConnectorContext(block_size=BLOCK, tensor_parallel_size=world, rank=rank,
                                 architecture="LlamaForCausalLM", dtype=dtype, model="tiny")
    return LocalDiskConnector(config, side, context)


def caches(num_blocks=6, heads=2, head_dim=3, layers=2, seed=0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (heads, num_blocks, BLOCK, head_dim)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(layers)]


def request(tokens: list[int], *, block_ids=(), computed=0, scheduled=0) -> KVConnectorRequest:
    hashes, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hash_block(parent, tokens[start:start + BLOCK])
        hashes.append(parent)
    return KVConnectorRequest(request_id="r", prompt_token_ids=tokens, block_hashes=hashes, block_ids=list(block_ids),
                              num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def test_a_producer_saves_what_a_step_completes_and_a_consumer_loads_it_elsewhere(tmp_path):
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks and 3
    scheduler = connector(tmp_path, SCHEDULER, "both")
    # A step that computes tokens 0..7 of the prompt in blocks 3 and 5 completes both full blocks.
    metadata = scheduler.build_connector_meta([request(tokens, block_ids=[3, 5, 1], computed=0, scheduled=8)])
    keys = [h.hex() for h in request(tokens).block_hashes]
    assert metadata.saves == [BlockIO(3, keys[0]), BlockIO(5, keys[1])] and metadata.loads == []
    wire = LocalDiskConnector.decode_metadata(LocalDiskConnector.encode_metadata(metadata))
    assert wire == metadata

    produced = caches(seed=1)
    worker = connector(tmp_path, WORKER, "both")
    worker.register_kv_caches(produced)
    worker.wait_for_save(wire)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{key}.tp1-rank0.safetensors" for key in keys] + ["identity.tp1-rank0.json"])
    assert not list(tmp_path.glob(".*"))  # written to a temporary name and renamed: none left behind
    # Saved once: the same blocks in a later step are not saved again.
    assert scheduler.build_connector_meta([request(tokens, block_ids=[3, 5, 1], computed=0, scheduled=8)]) is None

    # A fresh consumer: both full blocks are supplied (the last prompt token is never).
    consumer = connector(tmp_path, SCHEDULER, "consumer", connector_role="consumer")
    assert consumer.get_num_new_matched_tokens(request(tokens), 0) == 8
    assert consumer.get_num_new_matched_tokens(request(tokens), 4) == 4  # after a local prefix-cache hit
    consumer.update_state_after_alloc(request(tokens, block_ids=[0, 2, 4]), 8)
    loads = consumer.build_connector_meta([request(tokens, block_ids=[0, 2, 4], computed=8, scheduled=3)])
    assert loads.loads == [BlockIO(0, keys[0]), BlockIO(2, keys[1])] and loads.saves == []  # a consumer never saves
    target = caches(seed=2)
    loader = connector(tmp_path, WORKER, "consumer", connector_role="consumer")
    loader.register_kv_caches(target)
    loader.start_load_kv(LocalDiskConnector.decode_metadata(LocalDiskConnector.encode_metadata(loads)))
    for (key, value), (key_from, value_from) in zip(target, produced):
        assert torch.equal(key[:, 0], key_from[:, 3]) and torch.equal(value[:, 2], value_from[:, 5])
        assert not torch.equal(key[:, 1], key_from[:, 1])  # untouched


def test_the_longest_saved_prefix_all_ranks_and_never_the_last_token(tmp_path):
    tokens = list(range(100, 112))  # exactly 3 blocks
    keys = [h.hex() for h in request(tokens).block_hashes]
    side = connector(tmp_path, SCHEDULER, "consumer", world=2, connector_role="consumer")

    def save(index: int, *ranks: int) -> None:
        for rank in ranks:
            side.block_file(keys[index], rank).write_bytes(b"x")

    save(0, 0, 1)
    save(1, 0)  # rank 1's shard is missing: block 1 is not saved yet
    save(2, 0, 1)
    assert side.get_num_new_matched_tokens(request(tokens), 0) == 4
    save(1, 1)
    # All three are saved, but the third holds the last prompt token, whose logits are needed.
    assert side.get_num_new_matched_tokens(request(tokens), 0) == 8
    assert side.get_num_new_matched_tokens(request(tokens + [7]), 0) == 12
    producer_only = connector(tmp_path, SCHEDULER, "producer", world=2, connector_role="producer")
    assert producer_only.get_num_new_matched_tokens(request(tokens + [7]), 0) == 0


def test_each_rank_keeps_its_own_shard_and_identity(tmp_path):
    tokens = list(range(4)) + [9]
    metadata = LocalDiskMetadata(saves=[BlockIO(1, request(tokens).block_hashes[0].hex())])
    for rank in (0, 1):
        worker = connector(tmp_path, WORKER, "producer", rank=rank, world=2, connector_role="producer")
        worker.register_kv_caches(caches(heads=1, seed=rank))
        worker.wait_for_save(metadata)
    names = sorted(p.name for p in tmp_path.iterdir())
    key = metadata.saves[0].key
    assert names == sorted([f"{key}.tp2-rank0.safetensors", f"{key}.tp2-rank1.safetensors",
                            "identity.tp2-rank0.json", "identity.tp2-rank1.json"])
    assert json.loads((tmp_path / "identity.tp2-rank1.json").read_text())["rank"] == 1


def test_blocks_of_another_model_are_refused_at_start_up(tmp_path):
    connector(tmp_path, WORKER, "producer", connector_role="producer").register_kv_caches(caches(head_dim=3))
    with pytest.raises(StartupError) as caught:
        connector(tmp_path, WORKER, "consumer", connector_role="consumer", dtype="bfloat16").register_kv_caches(
            caches(head_dim=5))
    assert str(caught.value) == (
        f"LocalDiskConnector: the KV blocks in {tmp_path} were saved by another model (dtype: saved 'float32', "
        "this model 'bfloat16'; head_dim: saved 3, this model 5); refusing to load or save them. Use another "
        "kv_connector_extra_config path for this model (or empty that directory)")
    # The same model is welcome.
    connector(tmp_path, WORKER, "consumer", connector_role="consumer").register_kv_caches(caches(head_dim=3))


def test_the_path_is_required(tmp_path):
    config = parse_kv_transfer_config({"kv_connector": "LocalDiskConnector"})
    context = KVConnectorContext(block_size=BLOCK, tensor_parallel_size=1, rank=0, architecture="A", dtype="float32",
                                 model="m")
    with pytest.raises(ConfigError, match=r'LocalDiskConnector needs kv_connector_extra_config \{"path": DIR\}'):
        LocalDiskConnector(config, SCHEDULER, context)
