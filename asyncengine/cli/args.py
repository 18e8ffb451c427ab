"""One CLI flag per EngineConfig field: `max_num_seqs` becomes `--max-num-seqs`.

Flags are derived from the Struct's fields and types, so a new option needs no CLI code. Dict fields
take JSON (`--hf-overrides '{"rope_theta": 5e5}'`); list fields take JSON or comma-separated values.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Set
from typing import Any

import msgspec

from asyncengine.config.engine import EngineConfig, config_from_dict
from asyncengine.errors import ConfigError

# Fields given as the positional MODEL argument rather than a flag.
_POSITIONAL = {"model"}

# vLLM's short forms of engine flags (`vllm serve -tp 2`), for the fields that exist here.
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "quantization": "-q"}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _base_types(annotation: Any) -> set[Any]:
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed strings
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return {t for arg in typing.get_args(annotation) for t in _base_types(arg)}
    return {origin or annotation}


def _json_value(field: str):
    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag_name(field)} takes JSON: {exc}") from exc

    return parse


def _list_value(text: str) -> list[Any]:
    if text.startswith("["):
        return json.loads(text)
    if text.startswith("{"):  # one JSON object (vLLM's `--lora-modules '{"name": ..., "path": ...}'`)
        return [json.loads(text)]
    return [item.strip() for item in text.split(",") if item.strip()]


def add_engine_arguments(parser: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None) -> None:
    """`defaults`: a command's own defaults for some fields (serve: in_process False), shown in --help."""
    add_struct_arguments(parser, EngineConfig, "engine options (EngineConfig fields)", skip=_POSITIONAL,
                         defaults=defaults)


def add_struct_arguments(parser: argparse.ArgumentParser, struct: type, title: str, *, skip: Set[str] = frozenset(),
                         defaults: dict[str, Any] | None = None) -> None:
    """One flag per field of the msgspec Struct `struct`; `defaults` overrides the help's default of a field."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(struct)
    for field in msgspec.structs.fields(struct):
        if field.name in skip:
            continue
        kinds = _base_types(hints[field.name]) - {type(None)}
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
        if kinds == {bool}:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif dict in kinds:
            kwargs["type"] = _json_value(field.name)
            kwargs["metavar"] = "JSON"
        elif list in kinds:
            kwargs["type"] = _list_value
            kwargs["metavar"] = "A,B"
        elif int in kinds:
            kwargs["type"] = int
        elif float in kinds:
            kwargs["type"] = float
        else:
            kwargs["type"] = str
        default = field.default if field.default is not msgspec.NODEFAULT else (
            "[]" if list in kinds else "{}")
        default = (defaults or {}).get(field.name, default)
        kwargs["help"] = f"default: {default}"
        short = (SHORT_FLAGS.get(field.name),) if struct is EngineConfig and field.name in SHORT_FLAGS else ()
        group.add_argument(flag_name(field.name), *short, **kwargs)


def engine_config_from_args(args: argparse.Namespace, *, model: str | None) -> EngineConfig:
    known = {f.name for f in msgspec.structs.fields(EngineConfig)}
    values = {name: value for name, value in vars(args).items() if name in known}
    values["model"] = model
    return config_from_dict(values)


def struct_values(args: argparse.Namespace, struct: type) -> dict[str, Any]:
    """The flags the user gave that belong to `struct`."""
    known = {f.name for f in msgspec.structs.fields(struct)}
    return {name: value for name, value in vars(args).items() if name in known}


__all__ = ["ConfigError", "add_engine_arguments", "add_struct_arguments", "engine_config_from_args", "flag_name",
           "struct_values"]
