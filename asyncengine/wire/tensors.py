"""TensorData (asyncengine/wire/multimodal.py) <-> torch: the one home of the conversion, used by the frontend
(processor outputs onto the wire) and the worker (back to tensors for the vision tower)."""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.wire.multimodal import TensorData

_BYTE_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def tensor_to_wire(tensor: torch.Tensor | np.ndarray) -> TensorData:
    """A tensor's contents as TensorData (its dtype's name, shape, C-contiguous bytes)."""
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    tensor = tensor.detach().to("cpu").contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    view = tensor.view(_BYTE_VIEW[tensor.dtype]) if tensor.dtype in _BYTE_VIEW else tensor
    return TensorData(dtype=dtype, shape=list(tensor.shape), data=view.numpy().tobytes())


def check_tensor_data(data: TensorData) -> torch.dtype:
    """TensorData's torch dtype, once its dtype, shape and byte count agree (a ValueError saying how they don't)."""
    dtype = getattr(torch, data.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor dtype {data.dtype!r} is not a torch dtype (float32, bfloat16, int64, ...)")
    if any(size < 0 for size in data.shape):
        raise ValueError(f"tensor shape {data.shape} has a negative size")
    numel = int(np.prod(data.shape)) if data.shape else 1
    if numel * dtype.itemsize != len(data.data):
        raise ValueError(f"tensor of shape {data.shape} and dtype {data.dtype} needs {numel * dtype.itemsize} bytes, "
                         f"got {len(data.data)}")
    return dtype


def tensor_from_wire(data: TensorData) -> torch.Tensor:
    """The tensor TensorData describes (on the CPU); a bad dtype or a size that does not match is a ValueError."""
    dtype = check_tensor_data(data)
    numel = int(np.prod(data.shape)) if data.shape else 1
    if numel == 0:
        return torch.empty(data.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data.data), dtype=_BYTE_VIEW.get(dtype, dtype))
    return flat.view(dtype).reshape(data.shape)


