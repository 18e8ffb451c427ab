"""`asyncengine generate PROMPT`: stream one completion of the prompt to the terminal."""

from __future__ import annotations

import argparse
import sys

import anyio

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
from asyncengine.cli.parser import CONFIG_FLAG, CONFIG_HELP, MODEL_HELP, CliParser
from asyncengine.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction[CliParser], platform=None) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion of PROMPT (chat template applied unless --raw)",
        usage="%(prog)s PROMPT [--model MODEL] [--config FILE.yaml] [options]",
        description="Stream a completion of PROMPT. Greedy by default, so the answer is reproducible; "
        "pass --temperature to sample.",
    )
    parser.add_argument("prompt", help="The prompt (a user message, unless --raw).")
    parser.add_argument("--model", default=argparse.SUPPRESS,
                        help=f"{MODEL_HELP} (default: SmolLM2-135M-Instruct)")
    parser.add_argument(CONFIG_FLAG, metavar="FILE", default=argparse.SUPPRESS, help=CONFIG_HELP)
    parser.add_argument("--raw", action="store_true", help="Send PROMPT as is, without the chat template.")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Tokens to generate at most; a value given here must fit under max_model_len. "
                             "(default: 256, or the room the prompt leaves)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="The sampling temperature; 0 is greedy. (default: 0.0)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="Sample among the likeliest tokens whose probabilities add up to P. (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="Sample among the K likeliest tokens; 0: all. (default: 0)")
    add_engine_arguments(parser)
    if platform is not None:
        from asyncengine.interfaces.plugin_code import plugin_hook

        with plugin_hook(platform, "pre_register_and_update"):
            platform.pre_register_and_update(parser)
    parser.set_defaults(handler=run)


_DEFAULT_MAX_TOKENS = 256


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args, model=getattr(args, "model", None))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.max_tokens is None:
        # A default, not the caller's value: capped at the room the prompt leaves (docs/sampling.md, "Limits").
        params = params.with_defaults({"max_tokens": _DEFAULT_MAX_TOKENS})
    else:
        params = params.clone(max_tokens=args.max_tokens)
    return anyio.run(_stream, config, args, params, backend="trio")


async def _stream(config, args: argparse.Namespace, params: SamplingParams) -> int:
    from asyncengine.frontend.async_engine import AsyncEngine

    async with AsyncEngine.start(config) as engine:
        prompt: object = args.prompt
        has_template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
        if not args.raw and has_template:
            prompt = await engine.chat_prompt([{"role": "user", "content": args.prompt}])
        async with engine.stream(prompt, params) as outputs:
            async for output in outputs:
                for completion in output.outputs:
                    sys.stdout.write(completion.text)
                    sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
