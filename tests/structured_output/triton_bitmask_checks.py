"""Run by test_triton_bitmask.py in a child process: the bitmask kernel (structured_output/triton_bitmask.py)
against its torch reference, on CPU under the Triton interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported) or compiled on CUDA when ASYNCENGINE_KERNEL_DEVICE=cuda. Prints one JSON line
per check: {"name", "device", "ok", "detail"}."""

from __future__ import annotations

import json
import os
import sys

DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernel is checked under the Triton interpreter), "
             "or with ASYNCENGINE_KERNEL_DEVICE=cuda on a GPU machine")

import torch  # noqa: E402

from asyncengine.structured_output.bitmask import apply_bitmask_torch as apply_bitmask_reference  # noqa: E402
from asyncengine.structured_output.triton_bitmask import apply_bitmask_triton  # noqa: E402

generator = torch.Generator().manual_seed(0)


def check(name: str, batch: int, vocab: int, num_words: int, rows: list[int], dtype: torch.dtype) -> None:
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    # random words, with every bit pattern (bit 31 included), plus an all-allowed and an all-refused word
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), num_words), generator=generator, dtype=torch.int64)
    words = words.to(torch.int32)
    words[0, 0], words[-1, -1] = -1, 0
    index = torch.tensor(rows, dtype=torch.long)
    expected = apply_bitmask_reference(logits.clone(), words, index)
    got = apply_bitmask_triton(logits.to(DEVICE), words.to(DEVICE), index.to(DEVICE)).cpu()
    ok = torch.equal(got, expected)  # -inf where refused, the very logits elsewhere: no tolerance
    detail = "" if ok else f"{int((got != expected).sum())} of {got.numel()} values differ"
    print(json.dumps({"name": name, "device": DEVICE, "ok": ok, "detail": detail}))


for dtype in (torch.float32, torch.float16, torch.bfloat16):
    short = str(dtype).removeprefix("torch.")
    # vocab a word multiple and not; rows a subset, out of order; the logits wider than the masks (padding);
    # a vocabulary over one block of columns
    check(f"subset of rows {short}", 5, 70, 3, [3, 0], dtype)
    check(f"word multiple {short}", 2, 64, 2, [0, 1], dtype)
    check(f"padding columns {short}", 3, 100, 2, [2, 1, 0], dtype)
    check(f"several blocks {short}", 2, 2500, 79, [1], dtype)
