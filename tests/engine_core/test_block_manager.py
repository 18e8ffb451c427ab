"""BlockManager: block counts, reference counts, LRU free queue and prefix caching.

Sequences are built by hand and `num_computed_tokens` is advanced by the test where a scheduler would
do it, so every expectation below follows from the block manager alone.
"""

from __future__ import annotations

import pytest

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.sequence import Sequence, hash_block
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions

BLOCK_SIZE = 4


def make_seq(tokens: list[int], request_id: str = "r", block_size: int = BLOCK_SIZE) -> Sequence:
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=list(tokens), sampling=SamplingOptions())
    return Sequence(request, block_size, arrival_index=0)


def allocate_all(manager: BlockManager, seq: Sequence) -> None:
    """Admit `seq` with whatever prefix is cached and compute all of its tokens, as one scheduler step would."""
    cached = manager.find_cached_prefix(seq)
    assert manager.allocate(seq, seq.num_tokens - len(cached) * manager.block_size, cached)
    seq.num_computed_tokens = seq.num_tokens


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


# -- sizes and counts ----------------------------------------------------------------------------------


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BLOCK_SIZE)


@pytest.mark.parametrize(
    ("num_tokens", "expected_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (17, 5)]
)
def test_allocate_takes_ceil_of_tokens_over_block_size(num_tokens: int, expected_blocks: int) -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(tokens(0, num_tokens))

    assert manager.blocks_needed(num_tokens) == expected_blocks
    assert manager.allocate(seq, num_tokens)

    assert len(seq.block_ids) == expected_blocks
    assert len(set(seq.block_ids)) == expected_blocks
    assert manager.num_free_blocks == 8 - expected_blocks
    assert all(manager.blocks[b].ref_count == 1 for b in seq.block_ids)
    assert sum(ref_counts(manager)) == expected_blocks


def test_allocate_grows_only_when_a_block_boundary_is_crossed() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(tokens(0, 6))

    assert manager.allocate(seq, 3)  # chunk 0..3: one block
    assert len(seq.block_ids) == 1
    seq.num_computed_tokens = 3

    assert manager.allocate(seq, 1)  # token 3 still fits in block 0
    assert len(seq.block_ids) == 1
    seq.num_computed_tokens = 4

    first = list(seq.block_ids)
    assert manager.allocate(seq, 2)  # tokens 4..5 need a second block
    assert len(seq.block_ids) == 2
    assert seq.block_ids[:1] == first  # existing blocks are kept, the new one appended
    assert manager.num_free_blocks == 6


def test_usage_counts_referenced_blocks_only() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    assert manager.usage == 0.0
    seq = make_seq(tokens(0, 8))
    allocate_all(manager, seq)
    assert manager.usage == pytest.approx(0.5)

    manager.free(seq)
    # Its content stays cached, but a cached-and-free block counts as free.
    assert manager.find_cached_prefix(make_seq(tokens(0, 9), "probe")) == [0, 1]
    assert manager.usage == 0.0
    assert manager.num_free_blocks == 4


# -- allocation failure --------------------------------------------------------------------------------


def test_allocate_fails_without_side_effects_when_blocks_are_short() -> None:
    manager = BlockManager(3, BLOCK_SIZE)
    holder = make_seq(tokens(0, 8), "holder")
    allocate_all(manager, holder)
    before = ref_counts(manager)

    seq = make_seq(tokens(100, 8), "big")
    assert not manager.allocate(seq, 8)  # needs 2, 1 free

    assert seq.block_ids == []
    assert seq.num_registered_blocks == 0
    assert manager.num_free_blocks == 1
    assert ref_counts(manager) == before

    # Exactly enough succeeds.
    small = make_seq(tokens(200, 4), "small")
    assert manager.allocate(small, 4)
    assert manager.num_free_blocks == 0


def test_allocate_with_cached_blocks_fails_without_taking_them() -> None:
    """Cached blocks that sit in the free queue count against the free blocks; on failure none is taken."""
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_seq(tokens(0, 9), "first")
    allocate_all(manager, first)  # blocks 0, 1 (full, cached), 2 (partial)
    manager.free(first)
    filler = make_seq(tokens(500, 4), "filler")
    assert manager.allocate(filler, 4)  # takes block 3, the least recently used
    assert filler.block_ids == [3]

    # Same 8-token prefix, then 8 more tokens: 2 cached blocks + 2 new blocks, but only 3 are free.
    seq = make_seq(tokens(0, 8) + tokens(900, 8), "second")
    cached = manager.find_cached_prefix(seq)
    assert cached == [0, 1]
    assert not manager.allocate(seq, 8, cached)

    assert seq.block_ids == []
    assert manager.num_free_blocks == 3
    assert [manager.blocks[b].ref_count for b in cached] == [0, 0]
    assert manager.find_cached_prefix(make_seq(tokens(0, 9), "probe")) == [0, 1]  # still cached

    # With one block fewer needed it fits: 2 cached from the free queue + 1 new = 3.
    shorter = make_seq(tokens(0, 8) + tokens(900, 4), "shorter")
    cached = manager.find_cached_prefix(shorter)
    assert manager.allocate(shorter, 4, cached)
    assert shorter.block_ids[:2] == [0, 1]
    assert manager.num_free_blocks == 0


# -- sharing and freeing -------------------------------------------------------------------------------


def test_shared_prefix_blocks_are_reference_counted() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    a = make_seq(tokens(0, 10), "a")  # blocks: full, full, partial
    allocate_all(manager, a)
    b = make_seq(tokens(0, 8) + [77, 78, 79], "b")  # same two full blocks, own tail
    allocate_all(manager, b)

    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [manager.blocks[x].ref_count for x in a.block_ids] == [2, 2, 1]
    assert manager.blocks[b.block_ids[2]].ref_count == 1
    assert manager.num_free_blocks == 8 - 4

    manager.free(a)
    assert a.block_ids == []
    assert [manager.blocks[x].ref_count for x in b.block_ids] == [1, 1, 1]
    assert manager.num_free_blocks == 8 - 3  # only a's private tail came back

    manager.free(b)
    assert manager.num_free_blocks == 8
    assert ref_counts(manager) == [0] * 8


def test_free_queues_tail_blocks_to_be_evicted_first() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(tokens(0, 12))
    allocate_all(manager, seq)
    assert seq.block_ids == [0, 1, 2]
    manager.free(seq)

    # Never-used block 3 is the least recently used; then the freed sequence's blocks, tail first.
    taker = make_seq(tokens(100, 16), "taker")
    assert manager.allocate(taker, 16)
    assert taker.block_ids == [3, 2, 1, 0]


def test_blocks_freed_earlier_are_evicted_before_blocks_freed_later() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    a = make_seq(tokens(0, 8), "a")
    b = make_seq(tokens(100, 8), "b")
    allocate_all(manager, a)
    allocate_all(manager, b)
    manager.free(b)
    manager.free(a)  # a freed last: most recently used

    taker = make_seq(tokens(500, 8), "taker")
    assert manager.allocate(taker, 8)
    assert taker.block_ids == [3, 2]  # b's blocks, tail first
    # a's prefix survived; b's did not.
    assert manager.find_cached_prefix(make_seq(tokens(0, 9), "pa")) == [0, 1]
    assert manager.find_cached_prefix(make_seq(tokens(100, 9), "pb")) == []


# -- prefix caching ------------------------------------------------------------------------------------


def test_freed_block_stays_findable_until_reallocated() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    a = make_seq(tokens(0, 9), "a")  # blocks 0, 1 full; block 2 partial
    allocate_all(manager, a)
    full_hashes = a.block_hashes()
    manager.free(a)  # free queue: 3, 2, 1, 0
    probe = make_seq(tokens(0, 9), "probe")
    assert manager.find_cached_prefix(probe) == [0, 1]

    x = make_seq(tokens(100, 7), "x")  # takes blocks 3 and 2 (the partial one): the prefix survives
    assert manager.allocate(x, 7)
    assert x.block_ids == [3, 2]
    assert manager.find_cached_prefix(probe) == [0, 1]

    y = make_seq(tokens(200, 3), "y")  # takes block 1: its old content is evicted from the cache
    assert manager.allocate(y, 3)
    assert y.block_ids == [1]
    assert manager.blocks[1].block_hash is None
    assert manager.blocks[0].block_hash == (0, full_hashes[0])  # (group, hash)
    assert manager.find_cached_prefix(probe) == [0]


def test_reallocated_block_is_renamed_by_its_new_content() -> None:
    manager = BlockManager(2, BLOCK_SIZE)
    a = make_seq(tokens(0, 5), "a")
    allocate_all(manager, a)
    manager.free(a)
    b = make_seq(tokens(40, 8), "b")  # reuses both blocks, full: renamed by b's tokens
    allocate_all(manager, b)

    assert manager.find_cached_prefix(make_seq(tokens(0, 5), "pa")) == []
    assert manager.find_cached_prefix(make_seq(tokens(40, 9), "pb")) == b.block_ids
    assert [manager.blocks[x].block_hash for x in b.block_ids] == [(0, h) for h in b.block_hashes()]


@pytest.mark.parametrize(
    ("probe_tokens", "expected_blocks"),
    [
        (tokens(0, 4), 0),  # one full cached block == the whole sequence: nothing reusable
        (tokens(0, 5), 1),
        (tokens(0, 8), 1),  # two full cached blocks == the whole sequence: the last is recomputed
        (tokens(0, 9), 2),
        (tokens(0, 12), 2),  # third block was never cached
        (tokens(0, 4) + [999] + tokens(5, 4), 1),  # differs inside the second block
        ([999] + tokens(1, 8), 0),  # differs in the first block: the chained hash breaks everything after
    ],
)
def test_find_cached_prefix_leaves_at_least_one_token(probe_tokens: list[int], expected_blocks: int) -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    allocate_all(manager, make_seq(tokens(0, 8), "owner"))

    hits = manager.find_cached_prefix(make_seq(probe_tokens, "probe"))

    assert len(hits) == expected_blocks
    assert len(hits) * BLOCK_SIZE < len(probe_tokens)


def test_block_hash_is_chained_to_its_parent() -> None:
    block = tokens(10, 4)
    assert hash_block(None, block) == hash_block(None, block)
    assert hash_block(hash_block(None, tokens(0, 4)), block) != hash_block(hash_block(None, tokens(1, 4)), block)
    assert hash_block(None, block) != hash_block(None, block[::-1])


def test_full_blocks_are_registered_as_chunks_are_allocated() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(tokens(0, 13))
    probe = make_seq(tokens(0, 13), "probe")

    assert manager.allocate(seq, 5)  # block 0 full after this chunk, block 1 not
    seq.num_computed_tokens = 5
    assert manager.find_cached_prefix(probe) == seq.block_ids[:1]

    assert manager.allocate(seq, 7)  # up to 12 tokens: blocks 1 and 2 full
    seq.num_computed_tokens = 12
    assert manager.find_cached_prefix(probe) == seq.block_ids[:3]
    assert seq.num_registered_blocks == 3


def test_prefix_cache_counters_count_recorded_lookups_only() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    # Looking up does not count: the scheduler records a lookup once, when it admits the sequence.
    assert manager.find_cached_prefix(make_seq(tokens(0, 10), "probe")) == []
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    manager.record_prefix_lookup(10, 0)
    manager.record_prefix_lookup(9, 8)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (19, 8)


def test_disabled_prefix_caching_neither_finds_nor_names_blocks() -> None:
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    a = make_seq(tokens(0, 9), "a")
    allocate_all(manager, a)
    b = make_seq(tokens(0, 9), "b")

    assert manager.find_cached_prefix(b) == []
    assert all(block.block_hash is None for block in manager.blocks)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    allocate_all(manager, b)
    assert set(a.block_ids).isdisjoint(b.block_ids)


def test_evicting_a_duplicate_block_keeps_the_cached_original() -> None:
    """Two blocks can hold the same content (computed by two sequences before either was cached). The cache
    names the first; evicting the second must not drop the first's entry."""
    manager = BlockManager(4, BLOCK_SIZE)
    a = make_seq(tokens(0, 4), "a")
    b = make_seq(tokens(0, 4), "b")
    assert manager.allocate(a, 4)  # no prefix lookup: both compute block content themselves
    assert manager.allocate(b, 4)
    a.num_computed_tokens = b.num_computed_tokens = 4
    assert manager.blocks[a.block_ids[0]].block_hash == manager.blocks[b.block_ids[0]].block_hash
    probe = make_seq(tokens(0, 5), "probe")
    assert manager.find_cached_prefix(probe) == a.block_ids

    manager.free(b)
    evictor = make_seq(tokens(100, 12), "evictor")  # takes the 2 never-used blocks, then b's
    assert manager.allocate(evictor, 12)
    assert b.block_ids == [] and manager.blocks[1].ref_count == 1
    assert manager.find_cached_prefix(probe) == a.block_ids


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    kept = make_seq(tokens(0, 9), "kept")
    dropped = make_seq(tokens(100, 9), "dropped")
    allocate_all(manager, kept)
    allocate_all(manager, dropped)
    manager.free(dropped)

    manager.reset_prefix_cache()

    assert manager.find_cached_prefix(make_seq(tokens(0, 9), "p1")) == kept.block_ids[:2]
    assert manager.find_cached_prefix(make_seq(tokens(100, 9), "p2")) == []
    assert manager.num_free_blocks == 8 - 3


def test_an_engine_builds_its_block_manager_off_the_event_loop(tiny_model, make_llm, monkeypatch):
    """An object per block (74 ms for 200k blocks, 1.2 s for 2M) must not stall the event loop an in-process
    engine shares with its caller: the engine core builds the block manager in a worker thread."""
    import threading

    from asyncengine.engine_core import core

    threads = {}
    real_block_manager, real_engine_core_init = core.BlockManager, core.EngineCore.__init__

    def block_manager(*args, **kwargs):
        threads["block manager"] = threading.get_ident()
        return real_block_manager(*args, **kwargs)

    def engine_core_init(self, *args, **kwargs):  # runs on the engine core's event loop
        threads["event loop"] = threading.get_ident()
        real_engine_core_init(self, *args, **kwargs)

    monkeypatch.setattr(core, "BlockManager", block_manager)
    monkeypatch.setattr(core.EngineCore, "__init__", engine_core_init)
    make_llm(str(tiny_model("llama").path), skip_tokenizer_init=True, max_model_len=64, plugins="",
             kv_cache_memory_bytes=2**20)
    assert set(threads) == {"block manager", "event loop"}
    assert threads["block manager"] != threads["event loop"]
