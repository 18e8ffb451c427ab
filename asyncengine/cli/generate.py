"""`asyncengine generate PROMPT`: stream one completion of the prompt to the terminal."""

from __future__ import annotations

import argparse
import sys

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
from asyncengine.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion of PROMPT (chat template applied unless --raw)",
        description="Stream a completion of PROMPT. Greedy by default, so the answer is reproducible; "
        "pass --temperature to sample.",
    )
    parser.add_argument("prompt", help="the prompt (a user message, unless --raw)")
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    add_engine_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from asyncengine.frontend.llm_engine import LLMEngine
    from asyncengine.frontend.output_processor import OutputKind
    from asyncengine.frontend.tokenizer import render_chat

    config = engine_config_from_args(args, model=args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    engine = LLMEngine(config)
    prompt: object = args.prompt
    has_template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
    if not args.raw and has_template:
        text = render_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}], engine.chat_template)
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    request_id = engine.add_request(None, prompt, params, OutputKind.DELTA)
    out = sys.stdout
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                for completion in output.outputs:
                    out.write(completion.text)
                    out.flush()
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)
    out.write("\n")
    return 0
