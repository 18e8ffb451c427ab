"""The `asyncengine` command: parses arguments, runs a subcommand, maps errors to exit codes.

Exit codes: 0 success; 1 the work failed (a failed start-up, a failed check); 2 unusable arguments
or configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from asyncengine._version import __version__
from asyncengine.cli.parser import CliParser, dashed, read_config_file, split_config_path
from asyncengine.errors import ConfigError, RequestError, StartupError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


# Commands that start an engine: the platform is resolved before their arguments are parsed, so it
# can add options of its own (Platform.pre_register_and_update).
ENGINE_COMMANDS = ("generate", "serve", "launch")


def build_parser(platform=None) -> argparse.ArgumentParser:
    from asyncengine.cli import generate, launch, plugins, serve

    parser = CliParser(prog="asyncengine", description="An async-native LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"asyncengine {__version__}")
    parser.add_argument(
        "--log-level", default=None, choices=["debug", "info", "warning", "error"],
        help="The log level of every logger. (default: warning; info for serve)"
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", required=True)  # CliParsers too
    generate.add_parser(subparsers, platform)
    serve.add_parser(subparsers, platform)
    launch.add_parser(subparsers, platform)
    plugins.add_parser(subparsers)
    return parser


def preresolve_platform(argv: list[str]):
    """Pre-parse --device and --plugins and resolve the platform (a traced phase, as in every start)."""
    import anyio

    from asyncengine.config.engine import config_from_dict
    from asyncengine.plugin_runtime.phases import resolve_platform_only
    from asyncengine.plugin_runtime.records import StartupTrace

    pre = CliParser(add_help=False)
    pre.add_argument("--device", default=argparse.SUPPRESS)
    pre.add_argument("--plugins", default=argparse.SUPPRESS)
    try:  # a --config file may name them too; the command line wins
        path, _ = split_config_path([dashed(arg) for arg in argv])
        from_file = read_config_file(path) if path is not None else {}
    except ValueError as exc:
        raise ConfigError(str(exc), field="config") from exc
    known, _ = pre.parse_known_args(argv)
    values = {name: vars(known).get(name, from_file.get(name)) for name in ("device", "plugins")}
    config = config_from_dict({"device": values["device"] or "auto", "plugins": values["plugins"]})
    return anyio.run(resolve_platform_only, config, StartupTrace("frontend"), backend="trio")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    platform, code = _reporting_errors(
        lambda: preresolve_platform(argv) if argv[:1] and argv[0] in ENGINE_COMMANDS else None)
    if code is not None:
        return code
    parser = build_parser(platform)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, (args.log_level or getattr(args, "log_level_default", "warning")).upper()),
        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    handler: Callable[[argparse.Namespace], int] = args.handler  # each command's run(args): its exit code
    result, code = _reporting_errors(lambda: handler(args))
    if code is not None:
        return code
    return result or 0


_Result = TypeVar("_Result")


def _reporting_errors(work: Callable[[], _Result]) -> tuple[_Result | None, int | None]:
    """Run `work`; on an error we raise on purpose, print one line and give the exit code."""
    try:
        return work(), None
    except ConfigError as exc:
        print(f"asyncengine: configuration error: {exc}", file=sys.stderr)
        return None, EXIT_USAGE
    except RequestError as exc:
        print(f"asyncengine: bad request: {exc}", file=sys.stderr)
        return None, EXIT_USAGE
    except StartupError as exc:
        print(f"asyncengine: start-up failed: {exc}", file=sys.stderr)
        return None, EXIT_FAILURE
    except BrokenPipeError:
        # The reader went away (`asyncengine plugins map | head`): it has what it wanted, so this is no failure.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return None, 0
    except KeyboardInterrupt:
        print("asyncengine: interrupted", file=sys.stderr)
        return None, 130
