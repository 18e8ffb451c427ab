"""Parallel state of a worker process: its tensor-parallel rank, its pipeline stage, and the collectives.

In the floor, so that the models (which shard their layers by it) and the worker (which initializes it)
both import it downward. One process group per engine over every rank (tensor_parallel_size x
pipeline_parallel_size of them), made with torch.distributed on the platform's backend; global rank r
is tensor-parallel rank r % tp of pipeline stage r // tp. With pipeline stages, each stage's ranks get a
tensor-parallel group of their own, and rank t of stage s sends its activations to rank t of stage s+1.
With a single rank nothing is initialized and the collectives are no-ops, so the model code is the same.

`rank()` and `world_size()` are the tensor-parallel ones (what a layer shards by).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncengine.errors import ConfigError


@dataclass
class ParallelState:
    rank: int = 0  # tensor-parallel rank, inside the stage
    world_size: int = 1  # tensor-parallel size
    pipeline_rank: int = 0  # this rank's stage
    pipeline_size: int = 1
    tensor_group: Any = None  # the stage's tensor-parallel group (None: the whole world, or no group at all)
    # enable_expert_parallel: the MoE layers split their experts over the tensor-parallel ranks instead of
    # each expert's matrices (asyncengine/models/layers/expert_parallel.py).
    expert_parallel: bool = False

    @property
    def global_rank(self) -> int:
        return self.pipeline_rank * self.world_size + self.rank

    @property
    def global_size(self) -> int:
        return self.pipeline_size * self.world_size


_state = ParallelState()
# Seconds this rank spent waiting on other stages (their activations, the sampled tokens): the pipeline
# bubble as this rank saw it (bench/distributed.py reads it through a worker extension).
_pipeline_wait = [0.0]


def initialize(rank: int, world_size: int, init_method: str | None, backend: str, *,
               pipeline_parallel_size: int = 1, expert_parallel: bool = False) -> None:
    """Join the process group (`backend` is the platform's dist_backend: gloo on CPU, NCCL on CUDA).
    `rank` and `world_size` are global: tensor_parallel_size x pipeline_parallel_size ranks."""
    global _state
    tensor_size = world_size // pipeline_parallel_size
    _state = ParallelState(rank % tensor_size, tensor_size, rank // tensor_size, pipeline_parallel_size,
                           expert_parallel=expert_parallel and tensor_size > 1)
    if world_size == 1:
        return
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    if pipeline_parallel_size > 1 and tensor_size > 1:
        # Every rank takes part in making every group (torch.distributed's rule), and keeps its own.
        for stage in range(pipeline_parallel_size):
            group = dist.new_group(list(range(stage * tensor_size, (stage + 1) * tensor_size)))
            if stage == _state.pipeline_rank:
                _state.tensor_group = group


def destroy() -> None:
    global _state
    if _state.global_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def rank() -> int:
    return _state.rank


def world_size() -> int:
    return _state.world_size


def global_rank() -> int:
    """This rank among all of the engine's (tensor_parallel_size x pipeline_parallel_size)."""
    return _state.global_rank


def expert_parallel() -> bool:
    """Whether the MoE layers split their experts over the tensor-parallel ranks (enable_expert_parallel, with
    more than one rank) instead of each expert's matrices."""
    return _state.expert_parallel


def tensor_group() -> Any:
    """The stage's tensor-parallel process group (None: the whole world, or no group: one rank)."""
    return _state.tensor_group


def pipeline_rank() -> int:
    return _state.pipeline_rank


def pipeline_size() -> int:
    return _state.pipeline_size


def is_first_stage() -> bool:
    return _state.pipeline_rank == 0


def is_last_stage() -> bool:
    return _state.pipeline_rank == _state.pipeline_size - 1


def stage_layers(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this rank's stage holds: split as evenly as possible (an
    uneven count gives the earlier stages one more), every stage at least one."""
    stages = _state.pipeline_size
    if num_layers < stages:
        raise ConfigError(f"{num_layers} layers cannot be split over pipeline_parallel_size={stages}: every "
                         "stage needs at least one layer; lower pipeline_parallel_size", field="pipeline_parallel_size")
    return split_evenly(num_layers, stages)[_state.pipeline_rank]


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the stage's tensor-parallel ranks, in place."""
    if _state.world_size > 1:
        dist.all_reduce(tensor, group=_state.tensor_group)
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
    dist.all_gather(gathered, tensor.contiguous(), group=_state.tensor_group)
    return torch.cat([part[..., :size] for part, size in zip(gathered, sizes)], dim=-1)


def all_gather_rows(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each tensor-parallel rank's `tensor` along the first dimension; rank r contributes
    `sizes[r]` rows (padded to the largest for the collective, trimmed after)."""
    if _state.world_size == 1:
        return tensor
    tallest = max(sizes)
    padded = tensor
    if tensor.shape[0] < tallest:
        padded = torch.cat([tensor, tensor.new_zeros((tallest - tensor.shape[0],) + tuple(tensor.shape[1:]))])
    gathered = [torch.empty_like(padded) for _ in range(_state.world_size)]
    dist.all_gather(gathered, padded.contiguous(), group=_state.tensor_group)
    return torch.cat([part[:size] for part, size in zip(gathered, sizes)])


def exchange_counts(send_counts: list[int], device: torch.device) -> list[int]:
    """Each tensor-parallel rank tells every other how many rows it will send it: `send_counts[r]` rows go
    from here to rank r; returns, per rank r, the rows rank r sends here."""
    if _state.world_size == 1:
        return list(send_counts)
    sent = torch.tensor(send_counts, dtype=torch.int64, device=device)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=_state.tensor_group)
    return [int(count) for count in received.tolist()]


def all_to_all_rows(tensor: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
    """Rows to the tensor-parallel ranks: the first `send_counts[0]` rows of `tensor` to rank 0, the next
    `send_counts[1]` to rank 1, ...; returns the rows received, rank 0's first (`receive_counts[r]` from rank
    r, as `exchange_counts` told)."""
    out = tensor.new_empty((sum(receive_counts),) + tuple(tensor.shape[1:]))
    if _state.world_size == 1:
        return out.copy_(tensor)
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=receive_counts,
                           input_split_sizes=send_counts, group=_state.tensor_group)
    return out


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """This stage's activations to the same tensor-parallel rank of the next stage, in order. (A send
    returns once the next stage takes it: time spent here is waiting on that stage too.)"""
    started = time.perf_counter()
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=_state.global_rank + _state.world_size)
    _pipeline_wait[0] += time.perf_counter() - started


def receive_from_previous_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype,
                                device: torch.device) -> list[torch.Tensor]:
    """The previous stage's activations (as many, and of the shapes, it sent)."""
    received = []
    started = time.perf_counter()
    for shape in shapes:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=_state.global_rank - _state.world_size)
        received.append(tensor)
    _pipeline_wait[0] += time.perf_counter() - started
    return received


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of the last stage's first rank, on every rank (in place): the sampled tokens, which every
    stage keeps in its request states (the first embeds them in the next step)."""
    if _state.pipeline_size > 1:
        started = time.perf_counter()
        dist.broadcast(tensor, src=(_state.pipeline_size - 1) * _state.world_size)
        _pipeline_wait[0] += time.perf_counter() - started
    return tensor


def pipeline_wait_seconds() -> float:
    """Seconds this rank has waited on other pipeline stages since the process started."""
    return _pipeline_wait[0]


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part of `total` items split as evenly as possible, larger parts first."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges
