"""vLLM's checkpoint helpers that model loaders import (`vllm.model_executor.model_loader.weight_utils`), over
asyncengine's own safetensors reader (asyncengine/loader/safetensors_weights.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def safetensors_weights_iterator(hf_weights_files: list[str], use_tqdm_on_load: bool = False,
                                 safetensors_load_strategy: str = "lazy") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files, in order. vLLM's `use_tqdm_on_load` (a progress bar) and
    `safetensors_load_strategy` (how pages are read) change nothing here: the files are read lazily either way."""
    from asyncengine.loader.safetensors_weights import iterate_weights

    return iterate_weights([Path(name) for name in hf_weights_files])


def pt_weights_iterator(hf_weights_files: list[str], use_tqdm_on_load: bool = False,
                        pt_load_map_location: str | dict[str, str] = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of PyTorch checkpoint files (`*.bin`, `*.pt`), loaded with
    `weights_only=True` (tensors only, no code), as vLLM's does."""
    import torch

    for name in hf_weights_files:
        state = torch.load(name, map_location=pt_load_map_location, weights_only=True)
        yield from state.items()
        del state


# Files a training run leaves beside the weights, which vLLM's loaders skip.
_NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def filter_files_not_needed_for_inference(hf_weights_files: list[str]) -> list[str]:
    return [name for name in hf_weights_files if not name.endswith(_NOT_FOR_INFERENCE)]


def filter_duplicate_safetensors_files(hf_weights_files: list[str], hf_folder: str, index_file: str) -> list[str]:
    """Only the files the folder's safetensors index names, when it has one (a checkpoint saved whole and
    sharded side by side would load twice otherwise)."""
    import json
    import os

    index_path = os.path.join(hf_folder, index_file)
    if not os.path.isfile(index_path):
        return hf_weights_files
    with open(index_path, encoding="utf-8") as file:
        weight_map = json.load(file)["weight_map"]
    wanted = {os.path.join(hf_folder, name) for name in weight_map.values()}
    return [name for name in hf_weights_files if name in wanted]



__all__ = ["filter_duplicate_safetensors_files", "filter_files_not_needed_for_inference",
           "pt_weights_iterator", "safetensors_weights_iterator"]
