"""The argument parser of every `asyncengine` command: vLLM's launch-script forms, without argparse's guesses.

- No prefix matching (`allow_abbrev=False`, in every parser and sub-parser): an abbreviation is an unknown
  flag, so `--model x` is never taken for `--model-class-overrides x`.
- `--flag_name` is `--flag-name`, as vLLM accepts both.
- `--config FILE.yaml` (the commands that start an engine: serve, launch render, generate) reads vLLM's
  config file: a YAML mapping of flag names (with dashes or underscores, without the leading `--`) to
  values; `true` sets a boolean flag and `false` its `--no-` form, a list gives the flag's values, a
  mapping is passed as JSON, `null` leaves the default. The command line wins over the file, flag by
  flag (for a flag that takes several values, the command line's values replace the file's). A key that
  names no flag, a file that is not YAML or not a mapping is an error naming `--config` and the file.
  The file's `model` is used when the command line names none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

CONFIG_FLAG = "--config"
CONFIG_HELP = ("A YAML file of options, as vLLM's --config: flag names (dashes or underscores, no leading --) "
               "mapped to values; the command line wins over it.")
MODEL_HELP = "The model: a directory, a .gguf file or a name the loader knows."


def dashed(arg: str) -> str:
    """`--max_model_len=4k` -> `--max-model-len=4k`; anything that is not a long option is left as it is."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


class CliParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the forms above; sub-parsers made from it are CliParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        arguments = [dashed(arg) for arg in (sys.argv[1:] if args is None else args)]
        file_model = None
        if CONFIG_FLAG in self._option_string_actions:
            try:
                path, arguments = split_config_path(arguments)
            except ValueError as exc:
                self.error(str(exc))
            if path is not None:
                values = read_config_file(path, self)
                file_model = values.pop("model", None)
                arguments = self._file_arguments(path, values, given=arguments) + arguments
        parsed, extras = super().parse_known_args(arguments, namespace)
        if file_model is not None and not hasattr(parsed, "model_tag") and getattr(parsed, "model", None) is None:
            parsed.model = str(file_model)
        return parsed, extras

    def _file_arguments(self, path: str, values: dict[str, Any], *, given: list[str]) -> list[str]:
        """The file's options as `--flag=value` arguments (one token each, so none can swallow a positional
        argument of the command line); those of several-value flags the command line gives are left out."""
        given_flags = {arg.partition("=")[0] for arg in given if arg.startswith("--")}
        arguments: list[str] = []
        for key, value in values.items():
            flag = "--" + key
            action = self._option_string_actions.get(flag)
            if action is None or key in ("config", "help"):
                self.error(f"{CONFIG_FLAG} {path}: {key!r} names no option of this command (see --help)")
            if value is None:
                continue
            if isinstance(value, bool):
                negative = "--no-" + key
                if value or negative in self._option_string_actions:
                    arguments.append(flag if value else negative)
                elif action.nargs == 0:  # a store_true flag: false is its default
                    continue
                else:
                    arguments.append(f"{flag}={str(value).lower()}")
            elif isinstance(value, list):
                if action.nargs not in ("+", "*"):
                    self.error(f"{CONFIG_FLAG} {path}: {key!r} takes one value, not a list")
                if not set(action.option_strings) & given_flags:
                    arguments += [f"{flag}={_scalar(item)}" for item in value]
            else:
                arguments.append(f"{flag}={_scalar(value)}")
        return arguments


def _scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def split_config_path(arguments: list[str]) -> tuple[str | None, list[str]]:
    """The `--config FILE` (or `--config=FILE`) of `arguments`, and the arguments without it; a ValueError
    when it has no file."""
    for index, arg in enumerate(arguments):
        if arg == CONFIG_FLAG:
            if index + 1 >= len(arguments) or arguments[index + 1].startswith("-"):
                raise ValueError(f"argument {CONFIG_FLAG}: expected a YAML file")
            return arguments[index + 1], arguments[:index] + arguments[index + 2:]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.partition("=")[2], arguments[:index] + arguments[index + 1:]
    return None, arguments


def read_config_file(path: str, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The file's mapping, keys with dashes (`max_model_len` -> `max-model-len`). A problem with the file is
    the parser's usage error (exit 2), naming --config and the file; without a parser, a ValueError."""
    import yaml

    def fail(problem: str) -> NoReturn:
        message = f"{CONFIG_FLAG} {path}: {problem}"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)

    if Path(path).suffix not in (".yaml", ".yml"):
        fail("the config file must be YAML (.yaml or .yml), as vLLM's")
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        fail(f"cannot be read: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        fail(f"is not valid YAML: {' '.join(str(exc).split())}")  # one line: YAML's message spans several
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        fail("must be a mapping of option names to values (`max-model-len: 4096`)")
    return {key.removeprefix("--").replace("_", "-"): value for key, value in data.items()}


__all__ = ["CONFIG_FLAG", "CONFIG_HELP", "MODEL_HELP", "CliParser", "dashed", "read_config_file", "split_config_path"]
