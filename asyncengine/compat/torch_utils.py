"""vLLM's torch helpers that plugins import (`vllm.utils.torch_utils`, and `vllm.utils`' older spelling of
`direct_register_custom_op`), written here with vLLM's names and behaviour."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# vLLM registers its custom ops in a torch library named "vllm", and plugins call them as torch.ops.vllm.NAME:
# the same library name here, so that those calls run unchanged (vLLM itself is not installed beside us).
LIBRARY_NAME = "vllm"
_library: Any = None


def _vllm_library() -> Any:
    global _library
    if _library is None:
        from torch.library import Library

        _library = Library(LIBRARY_NAME, "FRAGMENT")
    return _library


def direct_register_custom_op(op_name: str, op_func: Callable[..., Any], mutates_args: list[str] | None = None,
                              fake_impl: Callable[..., Any] | None = None, target_lib: Any = None,
                              dispatch_key: str | None = None, tags: Sequence[Any] = ()) -> None:
    """Register `op_func` as the torch op `torch.ops.vllm.<op_name>` (or in `target_lib`), its schema inferred
    from its annotations, for `dispatch_key`: by default this process's platform's (vLLM's default), or, before
    the platform is resolved, every backend (CompositeExplicitAutograd), so that a plugin registering its ops at
    import works on whichever device it then runs. `fake_impl` is the op's shape function for torch.compile."""
    from torch.library import infer_schema

    if dispatch_key is None:
        dispatch_key = _platform_dispatch_key()
    library = target_lib if target_lib is not None else _vllm_library()
    library.define(op_name + infer_schema(op_func, mutates_args=mutates_args or []), tags=tuple(tags))
    library.impl(op_name, op_func, dispatch_key=dispatch_key)
    if fake_impl is not None:
        library._register_fake(op_name, fake_impl)


def _platform_dispatch_key() -> str:
    from asyncengine.errors import StartupError
    from asyncengine.plugin_runtime.platform_resolution import current_platform

    try:
        platform = current_platform()
    except StartupError:  # not resolved yet in this process
        return "CompositeExplicitAutograd"
    return str(getattr(platform, "dispatch_key", None) or "CompositeExplicitAutograd")


@contextlib.contextmanager
def set_default_torch_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the block, restored after it."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def current_stream() -> Any:
    """The current CUDA stream (vLLM's streams are CUDA streams). A process with no CUDA device has none: an
    error saying so, not a stream that would silently do nothing."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("current_stream(): this process has no CUDA device, so there is no CUDA stream (vLLM's "
                           "vllm.utils.torch_utils.current_stream is CUDA's); run this code path on a CUDA platform")
    return torch.cuda.current_stream()


__all__ = ["current_stream", "direct_register_custom_op", "set_default_torch_dtype"]
