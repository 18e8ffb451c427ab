"""vLLM's weight-loading protocol, which every layer here follows: a parameter carries `weight_loader(param,
loaded_weight[, shard_id])`, the function that copies a checkpoint tensor (whole, before any rank's split) into
it, taking this rank's part; `output_dim` / `input_dim` say which of its dimensions the tensor-parallel split
cuts (`set_weight_attrs`). A model's `load_weights` calls `getattr(param, "weight_loader",
default_weight_loader)(param, tensor[, shard_id])` for each checkpoint tensor (docs/porting.md, layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine.errors import ModelLoadError

if TYPE_CHECKING:  # no torch import here: vLLM's set_weight_attrs is importable without it
    import torch


def set_weight_attrs(weight: Any, weight_attrs: dict[str, Any] | None) -> None:
    """vLLM's: set attributes on a parameter (its `weight_loader`, `output_dim`, ...); refusing to overwrite
    one already set, as vLLM's does (with an error here, not an assert)."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        if hasattr(weight, key):
            raise AttributeError(f"set_weight_attrs: the parameter already has {key!r}; vLLM refuses to overwrite "
                                 "it, and so does asyncengine")
        setattr(weight, key, value)


def check_shape(loaded: Any, expected: tuple[int, ...], name: str) -> None:
    """The whole checkpoint tensor must have the shape config.json implies (before any rank takes its part)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, but the model built from "
            f"config.json expects {tuple(expected)}: the weights do not match the config"
        )


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy with a clear error when the checkpoint's tensor has the wrong shape."""
    check_shape(loaded, tuple(target.shape), name)
    target.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """vLLM's: the whole tensor into a parameter no rank splits (norms, a replicated layer's weight)."""
    copy_checked(param.data, loaded_weight, getattr(param, "checkpoint_name", "weight"))


__all__ = ["check_shape", "copy_checked", "default_weight_loader", "set_weight_attrs"]
