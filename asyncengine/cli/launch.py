"""`asyncengine launch COMPONENT`: one component of a deployment (vLLM's `vllm launch`).

`asyncengine launch render [MODEL]`: the render server (asyncengine/server/render_server.py), CPU only
and without an engine: /tokenize, /detokenize, /v1/models and the render routes
(/v1/chat/completions/render, /v1/completions/render) answer as `asyncengine serve`'s do; the routes
that generate or pool answer 503 (code no_engine). It takes serve's options (the engine's that shape
the model's config and tokenizer: --tokenizer, --chat-template, --max-model-len, --served-model-name,
...; the server's: --host, --port, --api-key, ...); those that only an engine uses are accepted and
have no effect.
"""

from __future__ import annotations

import argparse

import trio

from asyncengine.cli import serve
from asyncengine.cli.parser import CliParser

DESCRIPTION = "Launch one component of a deployment (vLLM's `vllm launch`)."
RENDER_HELP = "serve the render server: tokenizing and chat rendering over HTTP, without an engine (CPU only)"


def add_parser(subparsers: argparse._SubParsersAction[CliParser], platform=None) -> None:
    parser = subparsers.add_parser("launch", help=DESCRIPTION.lower().rstrip("."), description=DESCRIPTION)
    components = parser.add_subparsers(title="components", dest="component", required=True)
    render = components.add_parser(
        "render", help=RENDER_HELP, usage=serve.SERVER_USAGE,
        description=f"{RENDER_HELP[0].upper()}{RENDER_HELP[1:]}: /tokenize, /detokenize, /v1/models, "
                    "/v1/chat/completions/render and /v1/completions/render as `asyncengine serve` answers them; "
                    "generation routes answer 503.",
    )
    serve.add_server_arguments(render, platform)
    render.set_defaults(handler=run_render, log_level_default="info")


def run_render(args: argparse.Namespace) -> int:
    engine_config, server_config = serve.configs_from_args(args)
    from asyncengine.server.render_server import serve_render

    return trio.run(serve_render, engine_config, server_config)
