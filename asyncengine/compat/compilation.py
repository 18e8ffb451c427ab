"""vLLM's compilation settings' enums (`vllm.config`), with vLLM's members and values: platform plugins compare
`vllm_config.compilation_config`'s fields with them and set them in check_and_update_config. asyncengine compiles
nothing by these settings: what a platform sets is kept and listed as ignored in the start-up report
(docs/porting.md, platforms)."""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)


class CompilationMode(enum.IntEnum):
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CompilationLevel(enum.IntEnum):
    """vLLM's older name of CompilationMode."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3


__all__ = ["CUDAGraphMode", "CompilationLevel", "CompilationMode"]
