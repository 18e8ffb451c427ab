"""Build a layer as tensor-parallel rank `rank` of `size` would, in one process (no process group): the layers
read the rank while they are built; their collectives are the test's to do (a row-parallel layer built with
`reduce_results=False` returns its partial sum)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from asyncengine import parallel_state


@contextlib.contextmanager
def as_tensor_parallel_rank(rank: int, size: int) -> Iterator[None]:
    saved = parallel_state._state
    parallel_state._state = parallel_state.ParallelState(rank=rank, world_size=size)
    try:
        yield
    finally:
        parallel_state._state = saved
