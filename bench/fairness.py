"""Fairness: a short stream's time to first token beside one large fan-out, over HTTP (issue 30, item 5).

    python bench/fairness.py                        # n=128 x 32 tokens on --max-num-seqs 64, an 8-token stream
    python bench/fairness.py --n 64 --delay 0.5     # a quicker look

`asyncengine serve` runs as a subprocess (the engine core in its own process, serve's default) with
`--max-num-seqs`. One warm-up request, then the 8-token stream alone (the median of three), then the
fan-out: one streaming POST /v1/completions with `n` completions of `--max-tokens` tokens each
(`ignore_eos`), and `--delay` seconds after it was sent, the same 8-token stream beside it. Both through
the official `openai` AsyncOpenAI client on asyncio.

The engine holds one request's sequences to half of `--max-num-seqs` at once (docs/server.md,
"Fairness"), so the stream finds a free slot at once instead of waiting for the fan-out's first
`max_num_seqs` completions to end. Prints one line: the stream's TTFT beside the fan-out and alone, how
many of the fan-out's completions had finished when the stream's first token came, and the fan-out's
own time. `--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import start_server  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def measure(args, url: str, name: str) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900) as client:
        async def short_stream() -> float:
            """Seconds from sending the 8-token stream to its first chunk with text."""
            start = time.perf_counter()
            first = None
            stream = await client.completions.create(model=name, prompt=PROMPT, max_tokens=args.stream_tokens,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
            assert first is not None, "the stream sent no text"
            return first

        await short_stream()  # warm-up
        alone = statistics.median([await short_stream() for _ in range(3)])
        finished: set[int] = set()
        fan_out_done = asyncio.Event()

        async def fan_out() -> float:
            start = time.perf_counter()
            stream = await client.completions.create(model=name, prompt=PROMPT, n=args.n, max_tokens=args.max_tokens,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        finished.add(choice.index)
            fan_out_done.set()
            return time.perf_counter() - start

        async def beside() -> tuple[float, int, bool]:
            await asyncio.sleep(args.delay)
            running = not fan_out_done.is_set()
            ttft = await short_stream()
            return ttft, len(finished), running

        fan_out_seconds, (ttft, done_at_first_token, was_running) = await asyncio.gather(fan_out(), beside())
        if not was_running:
            raise RuntimeError(f"the fan-out ended within --delay {args.delay} s: lower --delay to measure beside it")
    return {"n": args.n, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
            "stream_tokens": args.stream_tokens, "delay_s": args.delay, "ttft_beside_s": round(ttft, 3),
            "ttft_alone_s": round(alone, 3), "fan_out_done_at_first_token": done_at_first_token,
            "fan_out_s": round(fan_out_seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=128, help="completions of the fan-out request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of each fan-out completion")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=8, help="tokens of the short stream")
    parser.add_argument("--delay", type=float, default=4.0, help="seconds between the fan-out and the stream")
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    parser.add_argument("--serve-args", default="", help="more `asyncengine serve` options, as one string "
                        "(e.g. \"--cpu-threads 1 --kv-cache-memory-bytes 536870912\")")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="asyncengine-fairness-bench-"))
    process, url, name = start_server(args.model, ["--max-num-seqs", str(args.max_num_seqs),
                                                   *shlex.split(args.serve_args)], directory)
    try:
        result = asyncio.run(measure(args, url, name))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    print(f"fairness: n={result['n']} x {result['max_tokens']} tokens on --max-num-seqs {result['max_num_seqs']}, "
          f"a {result['stream_tokens']}-token stream {result['delay_s']} s later: first token in "
          f"{result['ttft_beside_s']:.2f} s (alone {result['ttft_alone_s']:.2f} s), "
          f"{result['fan_out_done_at_first_token']} of the fan-out's {result['n']} completions done by then; "
          f"fan-out {result['fan_out_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
