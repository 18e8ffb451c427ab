"""The hybrid KV cache: the layout of groups (asyncengine/wire/kv_cache.py) and the block manager's sliding groups,
which keep only the blocks of each sequence's window, free the rest as it advances, and still serve prefix hits.

Sequences are advanced by hand as the scheduler would (allocate, then count the tokens computed)."""

from __future__ import annotations

import pytest

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.sequence import Sequence
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.kv_cache import NULL_BLOCK, KVCacheGroup, build_layout

BLOCK_SIZE = 4
WINDOW = 10  # a query reads its last 10 keys: at most ceil(9 / 4) = 3 blocks before its own


def make_seq(tokens: list[int], manager: BlockManager, request_id: str = "r") -> Sequence:
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=list(tokens), sampling=SamplingOptions())
    return Sequence(request, BLOCK_SIZE, arrival_index=0, num_kv_groups=manager.num_groups)


def live(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


# -- the layout ----------------------------------------------------------------------------------------


def test_layouts_of_the_models_users_run():
    gemma3 = build_layout({i: None if (i + 1) % 6 == 0 else 512 for i in range(18)})  # 270M: 15 local, 3 global
    assert gemma3.num_slots == 3 and len(gemma3.groups) == 6
    assert gemma3.groups[0] == KVCacheGroup([5, 11, 17], None)
    assert [g.layers for g in gemma3.groups[1:]] == [[0, 1, 2], [3, 4, 6], [7, 8, 9], [10, 12, 13], [14, 15, 16]]
    gemma2 = build_layout({i: 4096 if i % 2 == 0 else None for i in range(4)})
    assert gemma2.groups == [KVCacheGroup([1, 3], None), KVCacheGroup([0, 2], 4096)]
    assert build_layout({i: 32 for i in range(3)}).groups == [KVCacheGroup([0, 1, 2], 32)]  # Mistral: one group
    assert build_layout({i: None for i in range(3)}).groups == [KVCacheGroup([0, 1, 2], None)]
    uneven = build_layout({0: None, 1: 8, 2: 8, 3: None, 4: 8, 5: 8, 6: 8})
    assert [(g.layers, g.sliding_window) for g in uneven.groups] == [([0, 3], None), ([1, 2], 8), ([4, 5], 8),
                                                                      ([6], 8)]
    assert uneven.placement()[6] == (3, 0)


# -- the window ----------------------------------------------------------------------------------------


def test_a_sliding_group_keeps_only_its_window_while_the_full_group_grows():
    manager = BlockManager(64, BLOCK_SIZE, sliding_windows=[None, WINDOW])
    assert manager.num_usable_blocks == 63 and NULL_BLOCK not in manager._free  # the null block is reserved
    seq = make_seq(list(range(40)), manager)
    assert manager.allocate(seq, 40)  # the whole prompt in one step: every block, for its own queries
    seq.num_computed_tokens = 40
    assert len(live(seq.block_tables[1])) == 10
    for step in range(60):  # decode: one token a step
        seq.append_token(1000 + step)
        assert manager.allocate(seq, 1)
        position = seq.num_computed_tokens  # the token computed this step
        seq.num_computed_tokens += 1
        first_needed = (position - WINDOW + 1) // BLOCK_SIZE
        full, sliding = seq.block_tables
        assert len(full) == len(sliding) == position // BLOCK_SIZE + 1
        assert sliding[:first_needed] == [NULL_BLOCK] * first_needed  # out of every future window: released
        assert NULL_BLOCK not in sliding[first_needed:] and len(live(sliding)) <= 4
        assert manager.group_blocks_in_use == [len(full), len(live(sliding))]
    assert manager.num_free_blocks == 63 - len(seq.block_tables[0]) - len(live(seq.block_tables[1]))
    manager.free(seq)
    assert manager.usage == 0.0 and manager.group_blocks_in_use == [0, 0]
    assert all(block.ref_count == 0 for block in manager.blocks[1:])


def test_released_blocks_serve_the_full_group_and_other_sequences():
    """With room for one long sequence's full group plus a window, decoding past the pool's size works only because
    the sliding group hands its blocks back."""
    manager = BlockManager(1 + 30 + 4, BLOCK_SIZE, sliding_windows=[None, WINDOW])
    seq = make_seq(list(range(8)), manager)
    assert manager.allocate(seq, 8)
    seq.num_computed_tokens = 8
    for step in range(30 * BLOCK_SIZE - 8):
        seq.append_token(step)
        assert manager.allocate(seq, 1), f"out of blocks at token {seq.num_computed_tokens}"
        seq.num_computed_tokens += 1
    assert len(seq.block_tables[0]) == 30 and manager.num_free_blocks <= 1


# -- prefix caching ------------------------------------------------------------------------------------


def computed(manager: BlockManager, tokens: list[int], request_id: str) -> Sequence:
    seq = make_seq(tokens, manager, request_id)
    hit = manager.cached_prefix(seq)
    assert manager.allocate(seq, seq.num_tokens - len(hit[0]) * BLOCK_SIZE, cached_groups=hit)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    manager = BlockManager(64, BLOCK_SIZE, sliding_windows=[None, WINDOW])
    prompt = list(range(41))
    first = computed(manager, prompt[:40], "first")
    first_full = list(first.block_tables[0])
    manager.free(first)
    probe = make_seq(prompt, manager, "probe")
    full, sliding = manager.cached_prefix(probe)
    assert len(full) == len(sliding) == 10  # 40 of 41 tokens: every full block
    # A query at position 40 reads keys 31..40: blocks 7..9 of the sliding group; the rest stand as null.
    assert sliding[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in sliding[7:] and full == first_full

    second = computed(manager, prompt, "second")  # takes the hit: only the window's blocks come back
    assert second.block_tables[1][:7] == [NULL_BLOCK] * 7
    assert manager.group_blocks_in_use == [11, 4]  # the full prefix + its last block; the window + its last block


def test_evicting_a_block_inside_the_window_shortens_the_hit_and_outside_does_not():
    manager = BlockManager(64, BLOCK_SIZE, sliding_windows=[None, WINDOW])
    prompt = list(range(41))
    manager.free(computed(manager, prompt[:40], "first"))
    sliding_blocks = {block.block_id: block.block_hash for block in manager.blocks if block.block_hash
                      and block.block_hash[0] == 1}
    by_index = {}
    seq = make_seq(prompt, manager, "probe")
    for index, block_hash in enumerate(seq.block_hashes()):
        for block_id, key in sliding_blocks.items():
            if key == (1, block_hash):
                by_index[index] = block_id

    def evict(block_id: int) -> None:
        del manager._cached[manager.blocks[block_id].block_hash]
        manager.blocks[block_id].block_hash = None

    evict(by_index[2])  # far before the window of position 40
    assert len(manager.cached_prefix(make_seq(prompt, manager, "a"))[0]) == 10
    evict(by_index[8])  # inside it: a hit must end where blocks 8's absence does not matter
    hit = manager.cached_prefix(make_seq(prompt, manager, "b"))
    # Ending after block 7 needs blocks 5..7 (all cached); ending after 9 or 10 would need block 8.
    assert len(hit[0]) == 8 and hit[1][5:] == [by_index[5], by_index[6], by_index[7]]


def test_every_sliding_group_must_serve_the_hit():
    manager = BlockManager(64, BLOCK_SIZE, sliding_windows=[None, WINDOW, 6])
    prompt = list(range(33))
    manager.free(computed(manager, prompt[:32], "first"))
    seq = make_seq(prompt, manager, "probe")
    hashes = seq.block_hashes()
    victim = manager._cached.pop((2, hashes[7]))  # group 2's last block
    manager.blocks[victim].block_hash = None
    hit = manager.cached_prefix(seq)
    # Group 2 (window 6: 2 blocks) cannot end after block 7; ending after block 6 needs its blocks 5, 6.
    assert [len(ids) for ids in hit] == [7, 7, 7]


def test_one_group_managers_answer_as_before():
    manager = BlockManager(8, BLOCK_SIZE)
    assert not manager.reserves_null_block and manager.num_usable_blocks == 8
    seq = computed(manager, list(range(9)), "a")
    blocks = list(seq.block_ids)
    manager.free(seq)
    assert manager.find_cached_prefix(make_seq(list(range(9)), manager, "b")) == blocks[:2]
    hybrid = BlockManager(8, BLOCK_SIZE, sliding_windows=[None, WINDOW])
    with pytest.raises(ValueError, match="use cached_prefix"):
        hybrid.find_cached_prefix(make_seq([1, 2], hybrid))
