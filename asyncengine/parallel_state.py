"""Tensor-parallel state of a worker process: its rank among the workers and the collectives.

In the floor, so that the models (which shard their layers by it) and the worker (which initializes it)
both import it downward. One process group per engine, made with torch.distributed on the platform's
backend. With a single rank nothing is initialized and the collectives are no-ops, so the model code
is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1


_state = ParallelState()


def initialize(rank: int, world_size: int, init_method: str | None, backend: str) -> None:
    """Join the process group (`backend` is the platform's dist_backend: gloo on CPU, NCCL on CUDA)."""
    global _state
    _state = ParallelState(rank, world_size)
    if world_size == 1:
        return
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)


def destroy() -> None:
    global _state
    if _state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def rank() -> int:
    return _state.rank


def world_size() -> int:
    return _state.world_size


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place."""
    if _state.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each rank's `tensor` along the last dimension; rank r contributes `sizes[r]` columns.

    Shards may differ in size by one (an odd vocabulary split in two, say); gloo gathers equal
    shapes, so each shard is padded to the largest and trimmed after.
    """
    if _state.world_size == 1:
        return tensor
    widest = max(sizes)
    if tensor.shape[-1] < widest:
        tensor = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[-1]))
    gathered = [torch.empty_like(tensor) for _ in range(_state.world_size)]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.cat([part[..., :size] for part, size in zip(gathered, sizes)], dim=-1)


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part of `total` items split as evenly as possible, larger parts first."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges
