"""Applying token bitmasks to logits as one Triton kernel (CUDA); its torch reference, what the CPU runs,
is bitmask.py's `apply_bitmask_torch`.

`apply_bitmask_triton(logits, words, rows)`: for each i, logits row `rows[i]` keeps the tokens whose
bit is set in `words[i]` (backend.py's layout: bit `t % 32` of int32 word `t // 32`) and gets -inf
elsewhere, in place; columns past the masks' width (the vocabulary's padding) are never allowed.
One program per (constrained row, block of columns): the mask is unpacked in registers, never as a
[rows, vocab] boolean tensor in memory, and the logits are written only where a token is refused.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]  # no stubs (asyncengine.ops is exempt in pyproject; this is not ops)
import triton.language as tl  # type: ignore[import-untyped]

BLOCK = 1024  # columns per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, words_ptr, rows_ptr, logits_row_stride, words_row_stride, vocab, num_words,
                          BLOCK: tl.constexpr):
    mask_row = tl.program_id(0).to(tl.int64)
    logits_row = tl.load(rows_ptr + mask_row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word_index = cols // 32
    words = tl.load(words_ptr + mask_row * words_row_stride + word_index,
                    mask=in_vocab & (word_index < num_words), other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0  # bit 31 too: the arithmetic shift's sign bits are masked off
    # -inf made in float32 and cast (the interpreter has no bfloat16 constants; compiled, the cast is free)
    refused = tl.full([BLOCK], float("-inf"), dtype=tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + logits_row * logits_row_stride + cols, refused, mask=in_vocab & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`logits` [batch, vocab] (row-contiguous), `words` [n, num_words] int32, `rows` [n] int64, all on one
    device: logits row rows[i] masked by words[i], in place."""
    if words.dtype != torch.int32 or words.dim() != 2 or rows.shape != (words.shape[0],):
        raise ValueError(f"apply_bitmask_triton: words must be [n, num_words] int32 and rows [n]; got words "
                         f"{tuple(words.shape)} {words.dtype}, rows {tuple(rows.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("apply_bitmask_triton: the logits' last dimension must be contiguous (it writes in place)")
    words = words.contiguous()
    vocab = logits.shape[-1]
    if words.shape[0] and vocab:
        _apply_bitmask_kernel[(words.shape[0], triton.cdiv(vocab, BLOCK))](
            logits, words, rows, logits.stride(0), words.stride(0), vocab, words.shape[1], BLOCK=BLOCK)
    return logits

