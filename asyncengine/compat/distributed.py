"""vLLM's tensor-parallel helpers (`vllm.distributed`), over this engine's parallel state
(asyncengine/parallel_state.py): the rank and size a layer shards by, its group, and the collectives. With
one rank the collectives return their input, as vLLM's do; in a worker of a multi-rank engine they run on the
process group the worker joined in init_device."""

from __future__ import annotations

from typing import Any

from asyncengine import parallel_state as parallel


def get_tensor_model_parallel_rank() -> int:
    return parallel.rank()


def get_tensor_model_parallel_world_size() -> int:
    return parallel.world_size()


def tensor_model_parallel_all_reduce(input_: Any) -> Any:
    """The sum over the tensor-parallel ranks (in place where torch.distributed does it in place)."""
    return parallel.all_reduce(input_)


def tensor_model_parallel_all_gather(input_: Any, dim: int = -1) -> Any:
    """The ranks' tensors concatenated along `dim` (every rank's of the same shape, as vLLM's requires)."""
    if parallel.world_size() == 1:
        return input_
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(input_) for _ in range(parallel.world_size())]
    dist.all_gather(parts, input_.contiguous(), group=parallel.tensor_group())
    return torch.cat(parts, dim=dim)


class GroupCoordinator:
    """vLLM's view of a process group, for code that asks it for its rank and size or runs its collectives."""

    def __init__(self, rank_in_group: int, world_size: int) -> None:
        self.rank_in_group = rank_in_group
        self.world_size = world_size

    @property
    def rank(self) -> int:
        return parallel.global_rank()

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def device_group(self) -> Any:
        return parallel.tensor_group()

    def all_reduce(self, input_: Any) -> Any:
        return tensor_model_parallel_all_reduce(input_)

    def all_gather(self, input_: Any, dim: int = -1) -> Any:
        return tensor_model_parallel_all_gather(input_, dim)


def get_tensor_model_parallel_group() -> GroupCoordinator:
    return GroupCoordinator(parallel.rank(), parallel.world_size())


get_tp_group = get_tensor_model_parallel_group


def get_pp_group() -> GroupCoordinator:
    return GroupCoordinator(parallel.pipeline_rank(), parallel.pipeline_size())


def get_pipeline_model_parallel_rank() -> int:
    return parallel.pipeline_rank()


def get_pipeline_model_parallel_world_size() -> int:
    return parallel.pipeline_size()


__all__ = ["GroupCoordinator", "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
           "get_pp_group", "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_world_size", "get_tp_group", "tensor_model_parallel_all_gather",
           "tensor_model_parallel_all_reduce"]
