"""Applying token bitmasks to logits in the worker: one vectorised operation per step.

The engine core sends the masks of the constrained rows as packed int32 words (backend.py's
layout). On CUDA one Triton kernel (triton_bitmask.py) unpacks them in registers and writes -inf
where a token is refused; elsewhere torch unpacks them to booleans and masks all rows at once.
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
    mask_words = torch.from_numpy(packed[mask_rows]).to(logits.device, non_blocking=True)
    index = torch.tensor([row for _, row in pairs], dtype=torch.long, device=logits.device)
    if logits.is_cuda and logits.stride(-1) == 1:
        from asyncengine.structured_output.triton_bitmask import apply_bitmask_triton  # Triton only where it runs

        return apply_bitmask_triton(logits, mask_words, index)
    return apply_bitmask_torch(logits, mask_words, index)


def apply_bitmask_torch(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits row rows[i] masked by words[i] ([n, num_words] int32), in place: the torch path, and the Triton
    kernel's reference (apply_bitmask_triton takes the same arguments)."""
    allowed = unpack_bitmask(words, logits.shape[-1])
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))
    return logits
