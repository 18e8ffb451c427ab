"""The built-in CPU platform."""

from __future__ import annotations

import functools
import os
from typing import Any

from asyncengine.interfaces.platform import Platform, PlatformEnum

# CPU flags under which bfloat16 matmuls run natively (AMX tiles, AVX-512 BF16), several times
# float32's rate; elsewhere bfloat16 is emulated and slower than float32.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
AUTO_DTYPE_ENV = "ASYNCENGINE_CPU_AUTO_DTYPE"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_auto_dtype() -> str:
    """What dtype="auto" means on this CPU: bfloat16 with AMX or AVX-512 BF16, else float32;
    the environment variable ASYNCENGINE_CPU_AUTO_DTYPE, when set, names it instead."""
    override = os.environ.get(AUTO_DTYPE_ENV)
    if override:
        return override
    return "bfloat16" if cpu_flags() & set(BF16_CPU_FLAGS) else "float32"


class _AutoDtype:
    """`CpuPlatform.default_dtype`, worked out when an engine resolves its config (not at import)."""

    def __get__(self, instance: Any, owner: Any = None) -> str:
        return cpu_auto_dtype()


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_dtype = _AutoDtype()

    @classmethod
    def get_attn_backend_cls(cls, head_dim: int, dtype: Any, block_size: int) -> str:
        from asyncengine.interfaces.attention import TORCH_PAGED

        return TORCH_PAGED  # the built-in torch paged attention is the CPU path

    @classmethod
    def get_device_total_memory(cls, device: Any) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_current_memory_usage(cls, device: Any) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
