"""CpuExamplePlatform: the Platform interface for a CPU variant, every hook answered by this plugin.

What it changes against the built-in `cpu` platform:
- `check_and_update_config` sets `worker_cls="auto"` to its own worker (ExampleWorker) and validates
  the one option it claims, `additional_config["example_threads"]` (torch threads per worker);
- `pre_register_and_update` adds that option to `asyncengine serve` / `generate` as `--example-threads N`;
- `get_attn_backend_cls` chooses its own attention backend, EXAMPLE_SDPA, for every layer shape.
Its numerics are the CPU's: greedy outputs equal the built-in platform's.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from asyncengine.plugins_api import ConfigError, Platform

from ae_platform_example import ATTENTION_BACKEND, DEVICE_NAME, WORKER_CLASS
from ae_platform_example.record import record

THREADS_KEY = "example_threads"


class _ThreadsIntoAdditionalConfig(argparse.Action):
    """`--example-threads N` lands in `additional_config`, the dict every process receives (C9)."""

    def __call__(self, parser, namespace, values, option_string=None):
        merged = dict(getattr(namespace, "additional_config", None) or {})
        merged[THREADS_KEY] = values
        namespace.additional_config = merged


class CpuExamplePlatform(Platform):
    device_name = DEVICE_NAME
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = ("float32", "bfloat16")
    default_dtype = "float32"
    additional_config_keys = (THREADS_KEY,)

    # -- life cycle ----------------------------------------------------------------------------------

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        if parser is None:
            return
        parser.add_argument(
            "--example-threads", type=int, action=_ThreadsIntoAdditionalConfig, dest="example_threads",
            metavar="N", default=argparse.SUPPRESS,
            help=f"[platform {DEVICE_NAME}] torch threads in each worker (stored as additional_config"
                 f"[{THREADS_KEY!r}]; give it after --additional-config, which replaces the whole dict)",
        )

    @classmethod
    def check_and_update_config(cls, config: Any) -> Any:
        import msgspec

        threads = (config.additional_config or {}).get(THREADS_KEY)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"platform {DEVICE_NAME}: additional_config[{THREADS_KEY!r}] must be a positive "
                              f"integer (torch threads per worker), got {threads!r}", field="additional_config")
        if config.dtype not in ("auto", *cls.supported_dtypes):
            raise ConfigError(f"platform {DEVICE_NAME} runs {', '.join(cls.supported_dtypes)}, not dtype "
                              f"{config.dtype!r}", field="dtype")
        if config.worker_cls == "auto":
            config = msgspec.structs.replace(config, worker_cls=WORKER_CLASS)
        record("check_and_update_config", worker_cls=config.worker_cls, threads=threads)
        return config

    # -- selection -----------------------------------------------------------------------------------

    @classmethod
    def get_attn_backend_cls(cls, head_dim: int, dtype: Any, block_size: int) -> str:
        record("get_attn_backend_cls", head_dim=head_dim, dtype=str(dtype), block_size=block_size)
        return ATTENTION_BACKEND

    # -- device --------------------------------------------------------------------------------------

    @classmethod
    def get_device_total_memory(cls, device: Any) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_current_memory_usage(cls, device: Any) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
