"""vLLM's short forms of engine flags: `-tp N` is --tensor-parallel-size, `-q NAME` is --quantization."""

from __future__ import annotations

import argparse

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args


def test_vllm_short_flags_set_their_fields():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["-tp", "2", "-q", "int8"]), model=None)
    assert (config.tensor_parallel_size, config.quantization) == (2, "int8")
