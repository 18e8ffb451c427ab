"""The built-in CUDA platform."""

from __future__ import annotations

from typing import Any

from asyncengine.platforms.interface import Platform


class CudaPlatform(Platform):
    device_name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"

    @classmethod
    def is_available(cls) -> bool:
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
