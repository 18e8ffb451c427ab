"""The LoRA options: vLLM's flags and forms of --lora-modules, and their checks (no engine started)."""

from __future__ import annotations

import argparse

import pytest

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
from asyncengine.config.lora import LoRAModule, parse_lora_modules
from asyncengine.errors import ConfigError


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(flags)), model=None)


@pytest.mark.parametrize("value", [
    "sql=/a/sql,chat=/a/chat",
    '[{"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat", "base_model_name": "base"}]',
])
def test_lora_flags_take_vllm_forms(value):
    config = _config("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
                     "--lora-modules", value)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 3, 32, 5)
    assert [(m.name, m.path) for m in parse_lora_modules(config.lora_modules)] == [("sql", "/a/sql"),
                                                                                 ("chat", "/a/chat")]


def test_one_json_object_is_one_module():
    config = _config("--enable-lora", "--lora-modules", '{"name": "sql", "path": "/a/sql", "base_model_name": "b"}')
    assert parse_lora_modules(config.lora_modules) == [LoRAModule("sql", "/a/sql", "b")]


@pytest.mark.parametrize(("flags", "field"), [
    (["--lora-modules", "sql=/a"], "lora_modules"),  # without --enable-lora
    (["--enable-lora", "--lora-modules", "no-path"], "lora_modules"),
    (["--enable-lora", "--lora-modules", "a=/x,a=/y"], "lora_modules"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras"),
    (["--enable-lora", "--max-lora-rank", "0"], "max_lora_rank"),
])
def test_bad_lora_options_name_the_field(flags, field):
    with pytest.raises(ConfigError) as caught:
        _config(*flags)
    assert caught.value.field == field


def test_a_steps_assignment_gives_each_token_its_adapter():
    import numpy as np

    from asyncengine.lora.pool import step_assignment

    # three requests: 2 tokens of active adapter 1 (in slot 3), 1 base token, 3 tokens of adapter 0 (slot 0)
    onehot, token_slots = step_assignment(np.array([1, -1, 0]), np.array([2, 1, 3]), [0, 3])
    assert token_slots.tolist() == [3, 3, -1, 0, 0, 0]
    assert onehot.tolist() == [[0, 1], [0, 1], [0, 0], [1, 0], [1, 0], [1, 0]]


def test_an_adapter_named_as_the_served_model_fails_start_up():
    from asyncengine.frontend.lora import LoRAAdapters

    config = _config("--enable-lora", "--lora-modules", "base=/a/base")
    with pytest.raises(ConfigError, match="'base' is the served model's name") as caught:
        LoRAAdapters(config, served_model_name="base")
    assert caught.value.field == "lora_modules"
    assert [lora.lora_name for lora in LoRAAdapters(config, served_model_name="other").adapters()] == ["base"]


def test_a_safetensors_header_over_its_limit_is_refused_before_safetensors_reads_it(tmp_path):
    import struct

    from asyncengine.lora.peft import MAX_HEADER_BYTES, LoRAAdapterError, read_adapter_shapes

    (tmp_path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(LoRAAdapterError, match=f"declares a header of {MAX_HEADER_BYTES + 1} bytes"):
        read_adapter_shapes(str(tmp_path))
