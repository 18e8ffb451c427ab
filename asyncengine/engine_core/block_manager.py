"""BlockManager: which KV-cache blocks each sequence owns, with reference counts and prefix caching.

A block holds the keys and values of `block_size` consecutive tokens. A full block is named by the
chained hash of its tokens (see `Sequence.block_hashes`), so a new sequence whose prompt starts with
the same tokens reuses the block instead of recomputing it. Blocks nobody references go to a free
queue in least-recently-used order; a free block keeps its content (and stays findable by hash)
until it is handed out again, which is what makes a finished request's prefix reusable.

KV cache groups (the hybrid KV cache, asyncengine/wire/kv_cache.py): a model with sliding-window layers has
several groups of layers, each with its own block table per sequence (`Sequence.block_tables`), all drawing
from this one pool. In a sliding group, the blocks wholly before the window of a sequence's next token are
freed as the sequence advances (`allocate`), their place in its table taken by `NULL_BLOCK` (reserved, never
handed out): a sliding layer holds about `sliding_window / block_size + 1` blocks per sequence, not its whole
length. A freed block keeps its hash, so prefix caching still finds it: a prefix hit needs the full groups'
blocks of the whole prefix and, per sliding group, only the blocks its window reaches (`cached_prefix`).
"""

from __future__ import annotations

import collections.abc
from collections import OrderedDict

from asyncengine.engine_core.sequence import Sequence
from asyncengine.wire.kv_cache import NULL_BLOCK


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: tuple[int, bytes] | None = None  # (group, hash): the same tokens differ per group
        self.group = 0  # the group that last took it


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_windows: collections.abc.Sequence[int | None] = (None,)) -> None:
        """`sliding_windows`: one entry per KV cache group (None: full attention), the layout's order."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows: list[int | None] = list(sliding_windows) or [None]
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently used first. Values unused: an ordered set.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # With a sliding group, block 0 stands for the freed blocks in tables: never handed out.
        self.reserves_null_block = any(window is not None for window in self.sliding_windows)
        if self.reserves_null_block:
            if num_blocks < 2:
                raise ValueError("a KV cache with a sliding-window group needs at least two blocks (one is the "
                                 f"reserved null block), got {num_blocks}")
            del self._free[NULL_BLOCK]
        self._cached: dict[tuple[int, bytes], int] = {}
        self.group_blocks_in_use = [0] * len(self.sliding_windows)  # referenced blocks, per group
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -----------------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - int(self.reserves_null_block)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s tokens, for a manager of one group (the
        whole model's layers); `cached_prefix` answers for every group."""
        if self.num_groups != 1:
            raise ValueError(f"find_cached_prefix answers for one KV cache group; this manager has {self.num_groups}:"
                             " use cached_prefix")
        return self.cached_prefix(seq)[0]

    def cached_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the block ids of the longest prefix of `seq`'s tokens the cache can serve.

        A full-attention group needs every block of the prefix; a sliding group only those its window reaches
        from the first token to compute (the others stand as NULL_BLOCK). The prefix is the longest that every
        group can serve. At least one token is always left to compute, because the step that computes it
        produces the logits the next token is sampled from.
        """
        num_groups = self.num_groups
        if not self.enable_prefix_caching:
            return [[] for _ in range(num_groups)]
        hashes = seq.block_hashes()[: (seq.num_tokens - 1) // self.block_size]
        cached = self._cached
        found: list[list[int | None]] = []
        length = len(hashes)
        for group, window in enumerate(self.sliding_windows):
            if window is None:  # a full group's hit ends at its first miss
                ids: list[int | None] = []
                for block_hash in hashes[:length]:
                    block_id = cached.get((group, block_hash))
                    if block_id is None:
                        break
                    ids.append(block_id)
                length = len(ids)
            else:  # a sliding group's may have holes before the window: looked up over the whole prefix
                ids = [cached.get((group, block_hash)) for block_hash in hashes]
            found.append(ids)
        settled = False
        while not settled:  # each sliding group may shorten the hit, which the others must serve in turn
            settled = True
            for group, window in enumerate(self.sliding_windows):
                if window is not None:
                    shorter = self._longest_window_hit(found[group], length, window)
                    settled, length = settled and shorter == length, shorter
        hits = []
        for group, window in enumerate(self.sliding_windows):
            if window is None:
                hits.append([b for b in found[group][:length] if b is not None])
            else:
                reach = min(length, -(-(window - 1) // self.block_size))  # blocks a query at the end reads
                hits.append([NULL_BLOCK] * (length - reach) + [b for b in found[group][length - reach:length]
                                                                if b is not None])
        return hits

    def _longest_window_hit(self, ids: list[int | None], limit: int, window: int) -> int:
        """The largest n <= limit whose last ceil((window - 1) / block_size) blocks (all of them when fewer) are
        cached: what a sliding layer needs to compute the token after n blocks."""
        reach = -(-(window - 1) // self.block_size)
        run = 0
        runs = []
        for block_id in ids[:limit]:
            run = run + 1 if block_id is not None else 0
            runs.append(run)
        for n in range(limit, 0, -1):
            if runs[n - 1] >= min(reach, n):
                return n
        return 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (the scheduler calls it once per request, on admission)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: collections.abc.Sequence[int] = (), *,
                 cached_groups: collections.abc.Sequence[collections.abc.Sequence[int]] | None = None) -> bool:
        """Make `seq` own enough blocks to compute `num_new_tokens` more tokens.

        The prefix hit (from `cached_prefix`: `cached_groups`, one list per group; or `cached_block_ids`, for a
        manager of one group), only for a sequence that owns no blocks yet, is taken over first. In a sliding
        group, the blocks before the window of the first token to compute are released first (and never
        allocated for a prompt that starts past them). Returns False, having only released those, when too
        few blocks are free.
        """
        if cached_groups is None:
            if cached_block_ids and self.num_groups != 1:
                raise ValueError("with several KV cache groups, pass the prefix hit as cached_groups")
            cached_groups = [list(cached_block_ids)] + [[] for _ in range(self.num_groups - 1)]
        num_hit_blocks = len(cached_groups[0]) if cached_groups else 0
        first_token = seq.num_computed_tokens + num_hit_blocks * self.block_size
        num_tokens_after = first_token + num_new_tokens
        num_blocks_after = self.blocks_needed(num_tokens_after)
        new_blocks = []  # per group: the table indices that get a fresh block
        for group, window in enumerate(self.sliding_windows):
            table = seq.block_tables[group]
            start = len(table) + len(cached_groups[group])
            if window is not None:
                first_needed = max(0, first_token - window + 1) // self.block_size
                self._release_before(seq, group, first_needed)
                start = max(start, first_needed)
            new_blocks.append(max(0, num_blocks_after - start))
        # Cached blocks that sit in the free queue stop being free when we take them.
        num_cached_from_free = sum(1 for ids in cached_groups for b in ids
                                   if not self._is_null(b) and self.blocks[b].ref_count == 0)
        if sum(new_blocks) + num_cached_from_free > len(self._free):
            return False
        for group, ids in enumerate(cached_groups):
            table = seq.block_tables[group]
            for block_id in ids:
                if not self._is_null(block_id):
                    self._take(block_id, group)
                table.append(block_id)
        for group, count in enumerate(new_blocks):
            table = seq.block_tables[group]
            # A sliding group's prompt that starts past its window leaves its first blocks null.
            while len(table) < num_blocks_after - count:
                table.append(NULL_BLOCK)
            for _ in range(count):
                table.append(self._fresh_block(group))
        self._register_full_blocks(seq, num_tokens_after)
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of `seq` past the first `num_tokens` tokens' (speculative decoding: those only
        rejected drafts needed). Such blocks were never full of the sequence's tokens, so never named in the
        prefix cache."""
        keep = self.blocks_needed(num_tokens)
        for group, table in enumerate(seq.block_tables):
            while len(table) > keep:
                block_id = table.pop()
                if not self._is_null(block_id):
                    self._release(block_id, group)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. Its tail blocks are queued to be evicted first."""
        for group, table in enumerate(seq.block_tables):
            for block_id in reversed(table):
                if not self._is_null(block_id):
                    self._release(block_id, group)
        seq.block_tables = [[] for _ in seq.block_tables]
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for key, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].block_hash = None
                del self._cached[key]

    def _is_null(self, block_id: int) -> bool:
        return block_id == NULL_BLOCK and self.reserves_null_block

    def _fresh_block(self, group: int) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the stale content from the cache
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        block.group = group
        self.group_blocks_in_use[group] += 1
        return block_id

    def _take(self, block_id: int, group: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            block.group = group
            self.group_blocks_in_use[group] += 1
        block.ref_count += 1

    def _release(self, block_id: int, group: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            self.group_blocks_in_use[group] -= 1

    def _release_before(self, seq: Sequence, group: int, first_needed: int) -> None:
        """A sliding group's blocks before index `first_needed` of `seq`'s table: out of every future token's
        window, released (kept hashed, so still a prefix-cache hit) and marked null in the table."""
        table = seq.block_tables[group]
        for index in range(min(first_needed, len(table)) - 1, -1, -1):
            block_id = table[index]
            if self._is_null(block_id):
                break  # the ones before were released earlier
            self._release(block_id, group)
            table[index] = NULL_BLOCK

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
        for group, table in enumerate(seq.block_tables):
            for index in range(seq.num_registered_blocks, num_full):
                block_id = table[index]
                if self._is_null(block_id):
                    continue
                block = self.blocks[block_id]
                if block.block_hash is None:
                    block.block_hash = (group, hashes[index])
                    self._cached.setdefault(block.block_hash, block.block_id)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
