"""A proposer model's own paged KV cache (a draft model's, an EAGLE head's), kept per request across steps.

The draft runs the project's models and attention unchanged (asyncengine/models, the worker's attention
backends over `PagedAttention`): this module gives its attention layers a cache of their own, separate from
the target's blocks and the engine core's KV manager, and builds the `AttentionMetadata` of each draft
forward. Blocks are handed out here, per request, from a free list (the target's scheduler does not see
them: a draft cache that is full makes that request draft nothing until blocks come free, never fails it).

A request's cache holds `entries`: rows computed by the draft, in order, each with its position (rotary
uses it) and a key (the token id it was computed for, or its position for a head fed hidden states): the next
step keeps the longest prefix of entries still true (the drafts the target rejected, and anything after
them, are overwritten). Entries need not cover every position: a head that was given only some positions'
hidden states attends over those it was given (positions are passed to rotary as they are).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncengine.attention.selector import select_attention_backends
from asyncengine.errors import StartupError
from asyncengine.interfaces.spec_decode import Proposer
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.worker import kv_cache

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # one per entry
    positions: list[int] = field(default_factory=list)  # one per entry


@dataclass
class Chunk:
    """Rows a draft forward computes for one request: appended after the request's first `keep` entries;
    `reserve` more entries' blocks are taken now too (the drafts still to come this step), so that a request
    either gets all its drafts' room or none."""

    request_id: str
    keep: int
    keys: list[int]
    positions: list[int]
    reserve: int = 0
    continues_step: bool = False  # a later forward of the same step: the blocks reserved stay


class ProposerKVCache:
    """The paged KV cache of a proposer's model: `num_blocks` blocks of `block_size` tokens (fewer where
    `max_bytes` caps it) over the attention layers of `model`, bound to them (with the attention backend the
    platform chooses; none given: TORCH_PAGED)."""

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, platform: Any = None, max_bytes: int | None = None,
                 name: str = "draft") -> None:
        self.layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if not self.layers:
            raise StartupError(f"the {name} model has no attention layers (PagedAttention) to give a KV cache")
        windows = {layer.sliding_window for layer in self.layers}
        if windows != {None}:
            raise StartupError(f"the {name} model has sliding-window attention layers ({sorted(map(str, windows))}); "
                               "a proposer's own KV cache keeps every position and has no sliding-window groups: "
                               "choose a draft without sliding-window layers")
        layout = kv_cache.local_layout(self.layers)
        self.bytes_per_block = kv_cache.bytes_per_block(self.layers, layout, block_size, dtype)
        if max_bytes is not None:
            num_blocks = min(num_blocks, max_bytes // self.bytes_per_block)
        if num_blocks < 2:
            raise StartupError(f"the {name} KV cache needs at least 2 blocks of {self.bytes_per_block} bytes; it was "
                               f"given room for {num_blocks} (draft_kv_cache_bytes {max_bytes})")
        self.name, self.block_size, self.num_blocks, self.device = name, block_size, num_blocks, device
        kv_cache.allocate(self.layers, layout, num_blocks, block_size, dtype, device)
        choice = select_attention_backends(platform, self.layers, dtype, block_size,
                                           None if platform is not None else "TORCH_PAGED")
        for layer, backend in zip(self.layers, choice.backends):
            layer.backend = backend
        self.backend_summary = choice.summary()
        # Block 0 is never handed out: padding reads of a block table point at it.
        self._free = list(range(num_blocks - 1, 0, -1))
        self._sequences: dict[str, _Sequence] = {}
        self._warned_full = False

    # -- what the start-up report shows ------------------------------------------------------------------

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"{self.name} KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
                f"({(self.num_blocks - 1) * self.block_size} tokens), {self.num_bytes / 2**20:.1f} MiB, "
                f"{len(self.layers)} layers; attention {self.backend_summary}")

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    # -- per-request state --------------------------------------------------------------------------------

    def entries(self, request_id: str) -> tuple[list[int], list[int]]:
        """(keys, positions) of the entries the request's cache holds."""
        sequence = self._sequences.get(request_id)
        return ([], []) if sequence is None else (sequence.keys, sequence.positions)

    def remove(self, request_ids: list[str] | set[str]) -> None:
        """Forget requests (finished, aborted, preempted): their blocks go back to the free list."""
        for request_id in request_ids:
            sequence = self._sequences.pop(request_id, None)
            if sequence is not None:
                self._free.extend(sequence.blocks)

    def known(self) -> set[str]:
        return set(self._sequences)

    def _reserve(self, chunk: Chunk) -> bool:
        """Blocks for the request's entries after `chunk`; False (and the request forgotten) if they run out."""
        sequence = self._sequences.setdefault(chunk.request_id, _Sequence())
        keep = min(chunk.keep, len(sequence.keys))
        del sequence.keys[keep:], sequence.positions[keep:]
        needed = -(-(keep + len(chunk.keys) + chunk.reserve) // self.block_size)
        if not chunk.continues_step:  # a step's first chunk says what the request holds: free what is past it
            while len(sequence.blocks) > max(needed, 1):
                self._free.append(sequence.blocks.pop())
        if needed - len(sequence.blocks) > len(self._free):
            self.remove([chunk.request_id])
            if not self._warned_full:
                self._warned_full = True
                logger.warning("the %s is full (%d blocks): requests it cannot hold draft nothing until blocks come "
                               "free; give the draft more KV cache", self.describe(), self.num_blocks)
            return False
        while len(sequence.blocks) < needed:
            sequence.blocks.append(self._free.pop())
        return True

    def prepare(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Reserve blocks and build one forward's inputs for `chunks` (a request at most once): returns the
        chunks that fit (their rows in this order), the `positions` `[rows]`, the row of each chunk's last row
        `[chunks]`, and the attention metadata. The entries are recorded as computed: the caller runs the
        forward next."""
        fitted = [chunk for chunk in chunks if chunk.keys and self._reserve(chunk)]
        query_lens, seq_lens, slots, positions, tables = [], [], [], [], []
        for chunk in fitted:
            sequence = self._sequences[chunk.request_id]
            start = len(sequence.keys)
            entries = np.arange(start, start + len(chunk.keys))
            blocks = np.asarray(sequence.blocks, dtype=np.int64)
            slots.append(blocks[entries // self.block_size] * self.block_size + entries % self.block_size)
            sequence.keys.extend(chunk.keys)
            sequence.positions.extend(chunk.positions)
            positions.extend(chunk.positions)
            query_lens.append(len(chunk.keys))
            seq_lens.append(len(sequence.keys))
            tables.append(sequence.blocks)
        width = max((len(t) for t in tables), default=1)
        block_tables = np.zeros((len(tables), width), dtype=np.int64)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        last_rows = torch.tensor(np.cumsum(query_lens) - 1 if query_lens else [], dtype=torch.long, device=self.device)
        metadata = AttentionMetadata(
            torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)).to(self.device), None,
            query_lens, seq_lens, torch.from_numpy(block_tables).to(self.device), block_size=self.block_size)
        return fitted, torch.tensor(positions, dtype=torch.long, device=self.device), last_rows, metadata


def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of `block_size` tokens over every attention layer of `model`."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return kv_cache.bytes_per_block(layers, kv_cache.local_layout(layers), block_size, dtype) if layers else 0


def blocks_for(max_num_seqs: int, max_model_len: int, k: int, block_size: int) -> int:
    """Blocks that hold `max_num_seqs` requests of `max_model_len` tokens and k drafts each, plus block 0."""
    return max_num_seqs * -(-(max_model_len + k) // block_size) + 1


class CachedModelProposer(Proposer):
    """A proposer running a model of its own (`network`) on a `ProposerKVCache`: what the draft model and the
    EAGLE heads share (the cache's building, the start-up line, `remove`)."""

    network: torch.nn.Module | None = None
    cache: ProposerKVCache | None = None
    cache_name = "draft"

    def label(self) -> str:
        """What the start-up line calls the model."""
        return str(self.config.model)

    def build_cache(self, network: torch.nn.Module, max_len: int, name: str) -> None:
        """Keep `network`; allocate its cache now (room for max_num_seqs requests of `max_len` tokens and k
        drafts), unless the engine sizes it beside the target's (`initialize_kv_cache`)."""
        self.network, self.cache_name = network, name
        if not self.context.kv_cache_sized_by_engine:
            self.initialize_kv_cache(blocks_for(self.context.max_num_seqs, max_len,
                                                self.config.num_speculative_tokens, self.context.block_size) - 1)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        if self.network is None:
            raise RuntimeError(f"{type(self).__name__}.load_model must run before its KV cache is sized")
        return bytes_per_block(self.network, block_size, getattr(torch, self.context.dtype))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        context = self.context
        if self.network is None:
            raise RuntimeError(f"{type(self).__name__}.load_model must run before initialize_kv_cache")
        self.cache = ProposerKVCache(  # (+ 1: its block 0 is never handed out)
            self.network, num_blocks=num_blocks + 1, block_size=context.block_size,
            dtype=getattr(torch, context.dtype), device=torch.device(context.device), platform=context.platform,
            max_bytes=context.draft_kv_cache_bytes, name=self.cache_name)
        logger.info("speculative decoding: %s", self.describe())

    def kv_cache_usage(self) -> dict[str, int] | None:
        if self.cache is None:
            return None
        return {"num_blocks": self.cache.num_blocks - 1, "num_free_blocks": self.cache.free_blocks,
                "num_requests": len(self.cache.known())}

    def loaded_cache(self) -> ProposerKVCache:
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.load_model must run before propose")
        return self.cache

    def describe(self) -> str | None:
        if self.cache is None or self.network is None:
            return None
        weights = sum(p.numel() * p.element_size() for p in self.network.parameters())
        return f"{self.label()}, {weights / 2**20:.1f} MiB of weights; {self.cache.describe()}"

    def remove(self, request_ids: list[str]) -> None:
        if self.cache is not None:
            self.cache.remove(request_ids)


__all__ = ["CachedModelProposer", "Chunk", "ProposerKVCache", "blocks_for", "bytes_per_block"]
