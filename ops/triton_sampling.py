"""Sampling's draw as a Triton kernel, with the torch reference beside it.

`sample_triton(logits, temperature, seeds, noise=None)` is the "triton" provider of op "sample"
(the engine's `asyncengine.worker.sample_op.sample_native` is the "native" one). Per row of `logits`
`[B, V]` (float32, float16 or bfloat16):

- temperature 0: the argmax (the first index of the maximum, as `torch.argmax`);
- otherwise the exponential race `argmax(softmax(logits / T) / E)`, `E ~ Exp(1)` per token, which
  draws token i with probability softmax(logits / T)[i]. Taken here as `argmax(logits / T - log E)`:
  the softmax's normalization is one constant per row and log is increasing, so one pass over the
  vocabulary with a running argmax does it, with no softmax and nothing written per token.

E is `noise[row, col]` when a `noise` tensor (`[B, V]` float32) is given, so the kernel can be checked
against `sample_reference` on the same E; else it is drawn in the kernel, E = -log(U), U from Philox
(`tl.randint`) keyed by the row's 64-bit seed `seeds[row]` with the column as the counter. A row's
draw thus depends on its seed only: not on the batch, the tile size or how the vocabulary is split.
U takes the top 24 bits of the 32-bit draw, centred in its interval: U is in (0, 1) and E finite.

The vocabulary of a row is split over several programs when the batch is small (a decode step of a
few rows would otherwise run a few programs on a GPU of a hundred and more cores); each writes its
best (score, index) and torch picks the best split per row, the first on a tie, as argmax does.
Nothing leaves the device: the tokens come back as an int64 tensor on the logits' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary columns per loop iteration of a program
TARGET_PROGRAMS = 1024  # rows x splits aimed at: enough programs for every core at any batch size
# "No column seen yet" (every score of the split was -inf or NaN); a constexpr, the only kind of
# global a compiled kernel may read.
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _sample_kernel(logits_ptr, temperature_ptr, seeds_ptr, noise_ptr, best_score_ptr, best_index_ptr,
                   logits_row_stride, noise_row_stride, vocab, tiles_per_split, splits,
                   HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    lanes = tl.arange(0, BLOCK)
    first = split * tiles_per_split * BLOCK
    # One running best per lane; a later column replaces it only when strictly better, so each
    # lane keeps the first column of its maximum.
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], _NO_INDEX, tl.int32)
    for tile in range(tiles_per_split):
        cols = first + tile * BLOCK + lanes
        mask = cols < vocab
        x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if temperature == 0.0:
            score = x
        else:
            if HAS_NOISE:
                e = tl.load(noise_ptr + row * noise_row_stride + cols, mask=mask, other=1.0)
            else:
                bits = tl.randint(seed, cols)
                u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                e = -tl.log(u)
            score = x / temperature - tl.log(e)
        better = mask & (score > best_score)
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best_score, axis=0)
    index = tl.min(tl.where(best_score == top, best_index, _NO_INDEX), axis=0)
    # A split whose scores are all -inf (masked out) reports its first column at -inf: the row's
    # answer is then column 0 when every split is so, as torch.argmax of an all -inf row.
    index = tl.where(index == _NO_INDEX, first, index)
    tl.store(best_score_ptr + row * splits + split, top)
    tl.store(best_index_ptr + row * splits + split, index)


def _check(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           noise: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if temperature.shape != (batch,) or temperature.dtype != torch.float32:
        raise ValueError(f"sample: temperature must be float32 of shape ({batch},), got "
                         f"{temperature.dtype} {tuple(temperature.shape)}")
    if seeds.shape != (batch,) or seeds.dtype != torch.int64:
        raise ValueError(f"sample: seeds must be int64 of shape ({batch},), got {seeds.dtype} {tuple(seeds.shape)}")
    if noise is not None and (noise.shape != logits.shape or noise.dtype != torch.float32):
        raise ValueError(f"sample: noise must be float32 shaped like logits {tuple(logits.shape)}, got "
                         f"{noise.dtype} {tuple(noise.shape)}")


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  noise: torch.Tensor | None = None, *, block: int = BLOCK,
                  target_programs: int = TARGET_PROGRAMS) -> torch.Tensor:
    """One token per row (int64, on the logits' device); `block` and `target_programs` are for tests,
    which use small ones so that a small vocabulary still takes several tiles and splits."""
    _check(logits, temperature, seeds, noise)
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return torch.zeros(batch, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if noise is not None and noise.stride(-1) != 1:
        noise = noise.contiguous()
    tiles = triton.cdiv(vocab, block)
    tiles_per_split = triton.cdiv(tiles, min(tiles, max(1, target_programs // batch)))
    splits = triton.cdiv(tiles, tiles_per_split)
    best_score = torch.empty((batch, splits), dtype=torch.float32, device=logits.device)
    best_index = torch.empty((batch, splits), dtype=torch.int32, device=logits.device)
    _sample_kernel[(batch, splits)](
        logits, temperature.contiguous(), seeds.contiguous(), logits if noise is None else noise,
        best_score, best_index, logits.stride(0), 0 if noise is None else noise.stride(0), vocab,
        tiles_per_split, splits, HAS_NOISE=noise is not None, BLOCK=block)
    if splits == 1:
        return best_index[:, 0].long()
    return best_index.gather(1, best_score.argmax(dim=1, keepdim=True)).squeeze(1).long()


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The torch reference on explicit E: `argmax(logits / T - log E)` per row, the argmax where T is 0."""
    x = logits.float()
    greedy = temperature == 0
    scores = x / torch.where(greedy, 1.0, temperature).unsqueeze(1) - noise.log()
    return torch.where(greedy.unsqueeze(1), x, scores).argmax(dim=-1)

