"""A quantization method, `example_int4`: int4 weight-only, one scale per group of input columns.

    [project.entry-points."asyncengine.general_plugins"]
    ae_quant_example = "ae_quant_example:register"

Every process calls `register()`; `quantization="example_int4"` (`--quantization example_int4`) then
builds every ColumnParallelLinear / RowParallelLinear with it. Registering imports neither torch nor
the method's kernels and resolves no platform: it only adds a name to the registry (R4).

This package imports only asyncengine.plugins_api, as every plugin should.
"""

from __future__ import annotations

from asyncengine.plugins_api import register_quantization_config

__all__ = ["METHOD", "register"]

METHOD = "example_int4"


def register() -> None:
    from ae_quant_example.int4 import Int4GroupConfig  # torch-free module: torch loads when layers are built

    register_quantization_config(METHOD)(Int4GroupConfig)
