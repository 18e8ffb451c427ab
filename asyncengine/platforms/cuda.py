"""The built-in CUDA platform."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Any

from asyncengine.interfaces.platform import DeviceCapability
from asyncengine.interfaces.platform import Platform, PlatformEnum


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"
    dispatch_key = "CUDA"
    ray_device_key = "GPU"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        import torch

        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major=major, minor=minor)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        import torch

        return str(torch.cuda.get_device_name(device_id))

    @classmethod
    def device_count(cls) -> int:
        import torch

        return int(torch.cuda.device_count())

    @classmethod
    def supports_fp8(cls) -> bool:
        return cls.has_device_capability(89)

    @classmethod
    def is_available(cls) -> bool:
        if "torch" not in sys.modules and not _nvidia_device_present():
            return False  # no driver, so no GPU: spares the CLI a 2 s torch import just to hear "no"
        import torch

        return torch.cuda.is_available()

    @classmethod
    def set_device(cls, device: Any) -> None:
        import torch

        torch.cuda.set_device(device)

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        import torch

        super().seed_everything(seed)
        torch.cuda.manual_seed_all(seed)

    @classmethod
    def get_attn_backend_cls(cls, head_dim: int, dtype: Any, block_size: int) -> str:
        from asyncengine.interfaces.attention import TORCH_PAGED, TRITON_PAGED

        # The Triton decode kernel indexes a block's slots with tl.arange, so it needs a power-of-two
        # block size; without triton installed, or with another block size, the torch path runs on the GPU.
        if block_size > 0 and block_size & (block_size - 1) == 0 and importlib.util.find_spec("triton"):
            return TRITON_PAGED
        return TORCH_PAGED

    @classmethod
    def get_device_total_memory(cls, device: Any) -> int:
        import torch

        return torch.cuda.get_device_properties(device).total_memory

    @classmethod
    def get_current_memory_usage(cls, device: Any) -> int:
        import torch

        return torch.cuda.max_memory_allocated(device)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True


# vLLM's names of its CUDA platform's variants (device queries through NVML, or through torch): one class here.
CudaPlatformBase = NvmlCudaPlatform = NonNvmlCudaPlatform = CudaPlatform


def _nvidia_device_present() -> bool:
    """An NVIDIA driver's traces: its device nodes, its /proc entry, or WSL's GPU node."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/dxg")
