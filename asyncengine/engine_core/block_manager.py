"""BlockManager: which KV-cache blocks each sequence owns, with reference counts and prefix caching.

A block holds the keys and values of `block_size` consecutive tokens. A full block is named by the
chained hash of its tokens (see `Sequence.block_hashes`), so a new sequence whose prompt starts with
the same tokens reuses the block instead of recomputing it. Blocks nobody references go to a free
queue in least-recently-used order; a free block keeps its content (and stays findable by hash)
until it is handed out again, which is what makes a finished request's prefix reusable.
"""

from __future__ import annotations

import collections.abc
from collections import OrderedDict

from asyncengine.engine_core.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently used first. Values unused: an ordered set.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -----------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s tokens.

        At least one token is always left to compute, because the step that computes it produces the
        logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for block_hash in seq.block_hashes():
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (the scheduler calls it once per request, on admission)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: collections.abc.Sequence[int] = ()) -> bool:
        """Make `seq` own enough blocks to compute `num_new_tokens` more tokens.

        `cached_block_ids` (from `find_cached_prefix`, only for a sequence that owns no blocks yet) are
        taken over first. Returns False, changing nothing, when too few blocks are free.
        """
        num_owned = len(seq.block_ids) + len(cached_block_ids)
        num_tokens_after = seq.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_tokens_after) - num_owned)
        # Cached blocks that sit in the free queue stop being free when we take them.
        num_cached_from_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_cached_from_free > len(self._free):
            return False
        for block_id in cached_block_ids:
            self._take(block_id)
            seq.block_ids.append(block_id)
        for _ in range(num_new_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the stale content from the cache
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            seq.block_ids.append(block_id)
        self._register_full_blocks(seq, num_tokens_after)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. Its tail blocks are queued to be evicted first."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].block_hash = None
                del self._cached[block_hash]

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Name the blocks that will be full once `num_tokens` tokens are computed.

        Registering at allocation (before the step runs) is safe: a later sequence in the same step
        that hits these blocks reads them in attention after this step's keys and values are stored,
        and the scheduler never preempts a sequence it already scheduled in a step.
        """
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes()
        num_full = min(num_tokens // self.block_size, len(hashes))
        for index in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_ids[index]]
            if block.block_hash is None:
                block.block_hash = hashes[index]
                self._cached.setdefault(hashes[index], block.block_id)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
