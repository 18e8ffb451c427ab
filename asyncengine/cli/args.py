"""One CLI flag per field of EngineConfig and ServerConfig: `max_num_seqs` becomes `--max-num-seqs`.

Flags are derived from the Structs' fields, types and descriptions, so a new option needs no CLI code: its
one-line help is the field's `Meta(description=...)` (the one home of an option's description), followed
by its default. By type:
- bool: `--x` and `--no-x`;
- dict: JSON (`--hf-overrides '{"rope_theta": 5e5}'`);
- list: one or more values, and the flag may be repeated, as vLLM takes them (`--lora-modules a=P b=Q`,
  `--api-key k1 --api-key k2`, `--middleware a --middleware b`); a value may also be a JSON list, and, but
  for the flags in WHOLE_VALUES, comma-separated values (`--lora-modules a=P,b=Q`);
- int: vLLM's human-readable forms too: `4k` is 4,000 and `4K` 4,096 (k, m, g, t decimal; K, M, G, T
  binary, as vLLM's parser), and `--max-model-len auto` (or -1): the model's own length.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Set
from typing import Any

import msgspec

from asyncengine.config.engine import EngineConfig, config_from_dict

# Fields given as the positional MODEL argument rather than a flag.
_POSITIONAL = {"model"}

# vLLM's short forms of engine flags (`vllm serve -tp 2`), for the fields that exist here.
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "quantization": "-q"}

# List flags whose values are taken whole: a key or a model name may hold a comma.
WHOLE_VALUES = frozenset({"api_key", "served_model_name"})

# Integer fields that also take `auto` (or -1), as vLLM's do.
AUTO_INTS = frozenset({"max_model_len"})

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def human_readable_int(text: str) -> int:
    """`4096`, `4k` (4,000), `4K` (4,096), `25.6k` (25,600), `1m`, `1M`, ... as vLLM parses them: a decimal
    number takes only a decimal (lower-case) suffix."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (4096, 4k = 4000, 4K = 4096)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def human_readable_int_or_auto(text: str) -> int:
    """human_readable_int, or `auto` / `-1`: -1, which EngineConfig reads as "the model's own length"."""
    return -1 if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


def _base_types(annotation: Any) -> set[Any]:
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed strings
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return {t for arg in typing.get_args(annotation) for t in _base_types(arg)}
    return {origin or annotation}


def field_descriptions(struct: type) -> dict[str, str]:
    """Each field's one-line description: its `Meta(description=...)` (fields without one are left out)."""
    return {name: meta.description for name, annotation in typing.get_type_hints(struct, include_extras=True).items()
            for meta in getattr(annotation, "__metadata__", ()) if isinstance(meta, msgspec.Meta) and meta.description}


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


def _whole_value(text: str) -> list[Any]:
    return [text]


class _ExtendLists(argparse.Action):
    """Each value of a list flag gives a list; every occurrence of the flag adds its items."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items += [item for value in values for item in value]
        setattr(namespace, self.dest, items)


def add_engine_arguments(parser: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None) -> None:
    """`defaults`: a command's own defaults for some fields (serve: in_process False), shown in --help."""
    add_struct_arguments(parser, EngineConfig, "engine options (EngineConfig fields)", skip=_POSITIONAL,
                         defaults=defaults)


def add_struct_arguments(parser: argparse.ArgumentParser, struct: type, title: str, *, skip: Set[str] = frozenset(),
                         defaults: dict[str, Any] | None = None) -> None:
    """One flag per field of the msgspec Struct `struct`; `defaults` overrides the help's default of a field."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(struct)
    descriptions = field_descriptions(struct)
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
            # One or more values, repeatable: each value gives a list, and the flag's lists are joined.
            kwargs.update(nargs="+", action=_ExtendLists, type=_whole_value if field.name in WHOLE_VALUES else _list_value)
            kwargs["metavar"] = "VALUE"
        elif int in kinds:
            kwargs["type"] = human_readable_int_or_auto if field.name in AUTO_INTS else human_readable_int
        elif float in kinds:
            kwargs["type"] = float
        else:
            kwargs["type"] = str
        default = field.default if field.default is not msgspec.NODEFAULT else (
            "[]" if list in kinds else "{}")
        default = (defaults or {}).get(field.name, default)
        kwargs["help"] = f"{descriptions.get(field.name, '')} (default: {default})".strip()
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


__all__ = ["add_engine_arguments", "add_struct_arguments", "engine_config_from_args", "field_descriptions",
           "flag_name", "human_readable_int", "human_readable_int_or_auto", "struct_values"]
