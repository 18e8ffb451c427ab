"""The built-in CPU platform."""

from __future__ import annotations

import os
from typing import Any

from asyncengine.platforms.interface import Platform, PlatformEnum


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_dtype = "float32"

    @classmethod
    def get_attn_backend_cls(cls, head_dim: int, dtype: Any, block_size: int) -> str:
        from asyncengine.attention.registry import TORCH_PAGED

        return TORCH_PAGED  # the built-in torch paged attention is the CPU path

    @classmethod
    def get_device_total_memory(cls, device: Any) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_current_memory_usage(cls, device: Any) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
