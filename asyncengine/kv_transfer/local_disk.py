"""LocalDiskConnector, the built-in KV connector: full KV blocks of prompts, saved to and loaded from a
local directory (`kv_connector_extra_config: {"path": DIR}`).

Keys. A block is named by the prefix-caching chain hash of its tokens (engine_core/sequence.py): equal
names mean equal prefixes, so a consumer loads the longest run of saved blocks that starts where its
local prefix cache stops. Only full blocks of the prompt are saved, and the last prompt token is never
loaded (its logits are needed).

Files. Each worker rank saves its own shard: `DIR/<hash>.tp<size>-rank<rank>.safetensors` holds "key" and
"value", each (num_layers, num_kv_heads of the rank, block_size, head_dim). Written to a temporary name
and renamed, so a reader never sees half a file. A block counts as saved when every rank's file exists.

Model identity. Each rank writes `DIR/identity.tp<size>-rank<rank>.json` (architecture, dtype, layer
count, KV heads, head size, block size) the first time it saves. A rank whose identity differs from the
one in the directory refuses to start, naming both: blocks of another model are never loaded. (The
weights themselves are not fingerprinted: two checkpoints with the same shapes share a directory only
if you let them; give each model its own path.)
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import msgspec

from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.kv_connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRequest,
    KVConnectorRole,
)
from asyncengine.config.kv_transfer import FIELD, KVTransferConfig


class BlockIO(msgspec.Struct, array_like=True):
    block_id: int  # in the paged cache
    key: str  # the block's chain hash, hex


class LocalDiskMetadata(KVConnectorMetadata, kw_only=True):
    loads: list[BlockIO] = msgspec.field(default_factory=list)  # fill before the forward
    saves: list[BlockIO] = msgspec.field(default_factory=list)  # save after it


def _ours(metadata: KVConnectorMetadata) -> LocalDiskMetadata:
    """A step's metadata, as the worker decoded it with this connector's metadata_cls."""
    if not isinstance(metadata, LocalDiskMetadata):
        raise TypeError(f"LocalDiskConnector was handed {type(metadata).__qualname__}, not the LocalDiskMetadata "
                        "its decode_metadata builds")
    return metadata


class LocalDiskConnector(KVConnectorBase):
    metadata_cls = LocalDiskMetadata

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext) -> None:
        super().__init__(config, role, context)
        path = config.kv_connector_extra_config.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f'{FIELD}: {config.kv_connector} needs kv_connector_extra_config {{"path": DIR}}, '
                              f"the directory to keep KV blocks in; got {path!r}", field=FIELD)
        self.path = Path(path)
        self.block_size = context.block_size
        self.world_size = context.tensor_parallel_size
        self._loads: dict[str, list[BlockIO]] = {}  # scheduler side: admitted requests' blocks to load
        self._kv_caches: list[tuple[Any, Any]] = []  # worker side
        self.num_blocks_saved = 0
        self.num_blocks_loaded = 0

    def describe(self) -> str:
        return f"path {self.path}"

    # -- layout ----------------------------------------------------------------------------------------

    def block_file(self, key: str, rank: int) -> Path:
        return self.path / f"{key}.tp{self.world_size}-rank{rank}.safetensors"

    def identity_file(self, rank: int) -> Path:
        return self.path / f"identity.tp{self.world_size}-rank{rank}.json"

    def is_saved(self, key: str) -> bool:
        return all(self.block_file(key, rank).is_file() for rank in range(self.world_size))

    # -- scheduler side --------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> int:
        if not self.config.is_consumer:
            return 0
        size = self.block_size
        first = -(-num_computed_tokens // size)
        # Full prompt blocks that end before the last prompt token: that one is always computed.
        limit = (request.num_prompt_tokens - 1) // size
        found = first
        while found < limit and self.is_saved(request.block_hashes[found].hex()):
            found += 1
        return max(0, found * size - num_computed_tokens)

    def update_state_after_alloc(self, request: KVConnectorRequest, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        size = self.block_size
        first = request.num_computed_tokens // size
        end = -(-(request.num_computed_tokens + num_external_tokens) // size)
        self._loads[request.request_id] = [BlockIO(request.block_ids[i], request.block_hashes[i].hex())
                                           for i in range(first, end)]

    def build_connector_meta(self, requests: list[KVConnectorRequest]) -> LocalDiskMetadata | None:
        metadata = LocalDiskMetadata()
        size = self.block_size
        for request in requests:
            metadata.loads.extend(self._loads.pop(request.request_id, ()))
            if not self.config.is_producer:
                continue
            start = request.num_computed_tokens
            end = min(start + request.num_scheduled_tokens, request.num_prompt_tokens)
            # The prompt's blocks that this step's tokens complete.
            for index in range(start // size, end // size):
                key = request.block_hashes[index].hex()
                if not self.is_saved(key):
                    metadata.saves.append(BlockIO(request.block_ids[index], key))
        return metadata if metadata.loads or metadata.saves else None

    def request_finished(self, request: KVConnectorRequest) -> None:
        self._loads.pop(request.request_id, None)  # admitted, then aborted before its first step

    # -- worker side -----------------------------------------------------------------------------------

    def identity(self, kv_caches: list[tuple[Any, Any]]) -> dict[str, Any]:
        num_kv_heads, _, block_size, head_dim = kv_caches[0][0].shape
        return {"architecture": self.context.architecture, "dtype": self.context.dtype,
                "num_layers": len(kv_caches), "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
                "block_size": int(block_size), "tensor_parallel_size": self.world_size, "rank": self.context.rank}

    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]]) -> None:
        self._kv_caches = kv_caches
        self._identity = self.identity(kv_caches)
        path = self.identity_file(self.context.rank)
        if path.is_file():
            theirs = json.loads(path.read_text())
            if theirs != self._identity:
                raise StartupError(
                    f"{self.config.kv_connector}: the KV blocks in {self.path} were saved by another model "
                    f"({_differences(theirs, self._identity)}); refusing to load or save them. Use another "
                    "kv_connector_extra_config path for this model (or empty that directory)")
        elif self.config.is_producer:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, json.dumps(self._identity, sort_keys=True).encode())

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        from safetensors.torch import load_file

        for block in _ours(metadata).loads:
            path = self.block_file(block.key, self.context.rank)
            tensors = load_file(path)  # a missing or broken file fails the step, naming it
            key, value = tensors["key"], tensors["value"]
            if key.shape[0] != len(self._kv_caches) or key.shape[1:] != self._kv_caches[0][0][:, 0].shape:
                raise ValueError(f"{path}: a KV block of shape {tuple(key.shape)}, which does not fit this "
                                 "model's cache (the directory's identity file was changed by hand?)")
            for layer, (key_cache, value_cache) in enumerate(self._kv_caches):
                key_cache[:, block.block_id].copy_(key[layer].to(key_cache.device, non_blocking=False))
                value_cache[:, block.block_id].copy_(value[layer].to(value_cache.device, non_blocking=False))
            self.num_blocks_loaded += 1

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        import torch
        from safetensors.torch import save

        for block in _ours(metadata).saves:
            path = self.block_file(block.key, self.context.rank)
            if path.is_file():
                continue  # another engine saved the same prefix first: the content is the same
            key = torch.stack([k[:, block.block_id] for k, _ in self._kv_caches]).cpu().contiguous()
            value = torch.stack([v[:, block.block_id] for _, v in self._kv_caches]).cpu().contiguous()
            path.parent.mkdir(parents=True, exist_ok=True)  # (a subclass's layout may fan out)
            _write_atomically(path, save({"key": key, "value": value}))
            self.num_blocks_saved += 1


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers see all of it or nothing."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    keys = sorted(set(theirs) | set(ours))
    return "; ".join(f"{key}: saved {theirs.get(key)!r}, this model {ours.get(key)!r}" for key in keys
                     if theirs.get(key) != ours.get(key))
