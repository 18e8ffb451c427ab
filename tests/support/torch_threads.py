"""`one_torch_thread()`: torch on one thread for a block (correctness tests of small ops).

On a machine whose two cores other processes keep busy, two OpenMP threads spend most of a small op
waiting on each other (60x slower than one thread, measured on the MoE checks); a test that checks values,
not speed, loses nothing by running on one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
