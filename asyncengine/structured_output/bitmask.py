"""Applying token bitmasks to logits in the worker: one vectorised operation per step.

The engine core sends the masks of the constrained rows as packed int32 words (backend.py's
layout). On CUDA one Triton kernel (triton_bitmask.py) unpacks them in registers and writes -inf
where a token is refused. On the host, numpy unpacks the inverted words of the whole batch into
one byte per token (`np.unpackbits`, a C loop over bytes: a few ms for 32 rows of a 152k vocabulary)
and one in-place `masked_fill_` writes the -inf: the earlier torch unpacking (a [rows, words, 32]
int32 shift, a gather and a scatter of the rows) cost 5-8 times as much, several tenths of a second
per W3 step on the loaded 2-core machine, more than the step's forward pass (bench/RESULTS.md).
"""

from __future__ import annotations

import numpy as np
import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32 words -> [rows, vocab_size] bool, True where a token is allowed."""
    allowed = (words.unsqueeze(-1) >> _bit_positions(words.device)) & 1
    allowed = allowed.reshape(words.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:  # logits wider than the masks (padding rows of the vocabulary): never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed


def apply_bitmask(logits: torch.Tensor, words: bytes, num_words: int, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """`logits` with disallowed tokens set to -inf (in place): `pairs` are (mask row, logits row)."""
    packed = np.frombuffer(words, dtype=np.int32).reshape(-1, num_words)
    mask_rows = [mask_row for mask_row, _ in pairs]
    rows = [row for _, row in pairs]
    if logits.is_cuda and logits.stride(-1) == 1:
        from asyncengine.structured_output.triton_bitmask import apply_bitmask_triton  # Triton only where it runs

        mask_words = torch.from_numpy(packed[mask_rows]).to(logits.device, non_blocking=True)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return apply_bitmask_triton(logits, mask_words, index)
    refused = refused_tokens(packed, mask_rows, rows, num_rows=logits.shape[0], vocab_size=logits.shape[-1])
    logits.masked_fill_(refused.to(logits.device, non_blocking=True), float("-inf"))
    return logits


def refused_tokens(packed: np.ndarray, mask_rows: list[int], rows: list[int], *, num_rows: int,
                   vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool, True where logits row rows[i] refuses a token by mask row mask_rows[i];
    rows without a mask refuse nothing, and columns past the masks' width (the vocabulary's padding) are
    refused in the masked rows."""
    width = (vocab_size + 31) // 32
    inverted = np.zeros((num_rows, width), dtype=np.int32)  # a set bit: refused
    inverted[rows, :] = -1  # columns past the masks' width stay refused
    num_words = min(width, packed.shape[1])
    inverted[rows, :num_words] = np.invert(packed[mask_rows, :num_words])
    unpacked = np.unpackbits(inverted.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(unpacked).view(torch.bool)  # 0/1 bytes: a bool view, no copy


def apply_bitmask_torch(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits row rows[i] masked by words[i] ([n, num_words] int32), in place: the Triton kernel's
    reference, on any device (apply_bitmask_triton takes the same arguments)."""
    allowed = unpack_bitmask(words, logits.shape[-1])
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))
    return logits
