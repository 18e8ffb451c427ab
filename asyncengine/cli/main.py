"""The `asyncengine` command: parses arguments, runs a subcommand, maps errors to exit codes.

Exit codes: 0 success; 1 the work failed (a failed start-up, a failed check); 2 unusable arguments
or configuration.
"""

from __future__ import annotations

import argparse
import logging
import sys

from asyncengine._version import __version__
from asyncengine.errors import ConfigError, RequestError, StartupError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    from asyncengine.cli import generate

    parser = argparse.ArgumentParser(prog="asyncengine", description="An async-native LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"asyncengine {__version__}")
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="default: warning"
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", required=True)
    generate.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"asyncengine: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RequestError as exc:
        print(f"asyncengine: bad request: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StartupError as exc:
        print(f"asyncengine: start-up failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("asyncengine: interrupted", file=sys.stderr)
        return 130
