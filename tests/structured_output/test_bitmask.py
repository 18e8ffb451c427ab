"""The worker's application of the engine core's bitmasks: the bit layout and the rows it touches."""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.structured_output.backend import bitmask_words
from asyncengine.structured_output.bitmask import apply_bitmask, unpack_bitmask


def pack(allowed_rows: list[list[int]], vocab: int) -> np.ndarray:
    """The layout by hand: bit t % 32 of word t // 32, one row per mask."""
    words = np.zeros((len(allowed_rows), bitmask_words(vocab)), dtype=np.uint32)
    for row, allowed in enumerate(allowed_rows):
        for token in allowed:
            words[row, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return words.view(np.int32)


def test_unpacking_gives_back_exactly_the_allowed_tokens_including_bit_31():
    vocab = 70  # three words, the last one partly used
    allowed = [[0, 31, 32, 63, 69], [5]]
    unpacked = unpack_bitmask(torch.from_numpy(pack(allowed, vocab)), vocab)
    assert unpacked.shape == (2, vocab)
    assert [torch.nonzero(row).flatten().tolist() for row in unpacked] == allowed


def test_only_the_constrained_rows_are_masked_and_the_others_keep_their_logits():
    vocab = 40
    logits = torch.randn(3, vocab)
    before = logits.clone()
    words = pack([[1, 33], [7]], vocab).tobytes()
    # mask row 0 -> logits row 2, mask row 1 -> logits row 0; logits row 1 is unconstrained
    apply_bitmask(logits, words, bitmask_words(vocab), [(0, 2), (1, 0)])
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1, 33]
    assert torch.equal(logits[2, [1, 33]], before[2, [1, 33]])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [7]


def test_logits_wider_than_the_masks_never_allow_the_extra_columns():
    logits = torch.zeros(1, 40)
    apply_bitmask(logits, np.full((1, 1), -1, dtype=np.int32).tobytes(), 1, [(0, 0)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(32))


def test_the_host_path_matches_the_torch_reference_on_random_masks_and_row_orders():
    # apply_bitmask's numpy unpacking (the CPU path) against apply_bitmask_torch (the Triton kernel's reference)
    from asyncengine.structured_output.bitmask import apply_bitmask_torch

    rng = np.random.default_rng(0)
    vocab, num_words = 1000, bitmask_words(1000)
    packed = rng.integers(-2**31, 2**31 - 1, size=(3, num_words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(5, vocab)
    pairs = [(2, 4), (0, 1), (1, 3)]  # rows 0 and 2 unconstrained
    expected = apply_bitmask_torch(logits.clone(), torch.from_numpy(packed[[0, 1, 2]]), torch.tensor([1, 3, 4]))
    got = apply_bitmask(logits.clone(), packed.tobytes(), num_words, pairs)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
