"""The tensor-parallel state moved to asyncengine.parallel_state (the floor, which the models read
without importing the worker); this name stays for code that imports it from here."""

from __future__ import annotations

from asyncengine.parallel_state import (
    ParallelState,
    all_gather_last_dim,
    all_reduce,
    destroy,
    initialize,
    is_first_stage,
    is_last_stage,
    pipeline_rank,
    pipeline_size,
    rank,
    split_evenly,
    stage_layers,
    world_size,
)

__all__ = ["ParallelState", "all_gather_last_dim", "all_reduce", "destroy", "initialize", "is_first_stage",
           "is_last_stage", "pipeline_rank", "pipeline_size", "rank", "split_evenly", "stage_layers", "world_size"]
