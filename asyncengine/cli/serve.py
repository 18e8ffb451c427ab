"""`asyncengine serve [MODEL]`: the OpenAI-compatible HTTP server.

Engine options are EngineConfig's flags, server options ServerConfig's (`--host`, `--port`,
`--api-key`, `--tool-call-parser`, ...). The engine core runs in its own process unless
`--in-process` is given.
"""

from __future__ import annotations

import argparse

import msgspec
import trio

from asyncengine.cli.args import add_engine_arguments, add_struct_arguments, engine_config_from_args, struct_values
from asyncengine.cli.parser import CONFIG_FLAG, CONFIG_HELP, MODEL_HELP, CliParser
from asyncengine.config.engine import EngineConfig
from asyncengine.config.structured_outputs import with_reasoning_parser
from asyncengine.errors import ConfigError
from asyncengine.server.config import ServerConfig, server_config_from_dict


# The usage line (every option is listed under --help; an error then shows one line of usage, not eighty).
SERVER_USAGE = "%(prog)s [MODEL] [--config FILE.yaml] [options]"

# serve puts the engine core in its own process by default (EngineConfig's default is in-process, for LLM).
SERVE_ENGINE_DEFAULTS = {"in_process": False}


def add_parser(subparsers: argparse._SubParsersAction[CliParser], platform=None) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API over HTTP", usage=SERVER_USAGE,
        description="Serve MODEL (default: SmolLM2-135M-Instruct) over the OpenAI API at http://HOST:PORT/v1.",
    )
    add_server_arguments(parser, platform)
    parser.set_defaults(handler=run, log_level_default="info")


def add_server_arguments(parser: argparse.ArgumentParser, platform=None) -> None:
    """serve's arguments: MODEL, the server's options and the engine's (`launch render` takes them too)."""
    parser.add_argument("model_tag", metavar="MODEL", nargs="?", default=argparse.SUPPRESS,
                        help=f"{MODEL_HELP} (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model", default=argparse.SUPPRESS,
                        help="The model, as the positional MODEL (vLLM's older form).")
    parser.add_argument(CONFIG_FLAG, metavar="FILE", default=argparse.SUPPRESS, help=CONFIG_HELP)
    parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                        help="The log level of every logger. (default: info for serve: one line per request)")
    add_struct_arguments(parser, ServerConfig, "server options (ServerConfig fields)")
    add_engine_arguments(parser, defaults=SERVE_ENGINE_DEFAULTS)
    if platform is not None:
        from asyncengine.interfaces.plugin_code import plugin_hook

        with plugin_hook(platform, "pre_register_and_update"):
            platform.pre_register_and_update(parser)


def run(args: argparse.Namespace) -> int:
    engine_config, server_config = configs_from_args(args)
    from asyncengine.server.run import serve

    return trio.run(serve, engine_config, server_config)  # 1 when the engine died (server/run.py)


def model_argument(args: argparse.Namespace) -> str | None:
    """The model from the positional MODEL or --model (vLLM takes both); both naming different models is an
    error naming them, not a silent choice."""
    positional, option = getattr(args, "model_tag", None), getattr(args, "model", None)
    if positional is not None and option is not None and positional != option:
        raise ConfigError(f"the model is given twice: MODEL {positional!r} and --model {option!r}; give one",
                          field="model")
    return positional if positional is not None else option


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's options from serve's arguments (`launch render` takes them too)."""
    values = {**SERVE_ENGINE_DEFAULTS, **vars(args)}
    engine_config = engine_config_from_args(argparse.Namespace(**values), model=model_argument(args))
    server_config = server_config_from_dict(struct_values(args, ServerConfig))
    # vLLM's: --reasoning-parser also tells the engine core where a constrained output's grammar starts; not
    # one from a --reasoning-parser-plugin file, which only this process loads (docs/structured_outputs.md).
    structured = with_reasoning_parser(engine_config.structured_outputs_config,
                                       None if server_config.reasoning_parser_plugin else server_config.reasoning_parser)
    if structured is not engine_config.structured_outputs_config:
        engine_config = msgspec.structs.replace(engine_config, structured_outputs_config=structured)
    return engine_config, server_config
