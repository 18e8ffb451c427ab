"""Serving: 64 concurrent streaming clients over HTTP against the same load in-process, in the same run (W4).

    python bench/serve.py                      # W4: 64 clients, 128 output tokens each, the default model
    python bench/serve.py --num-clients 8 --max-tokens 32    # a quick check

Prompts are W3's draw (../shared/WORKLOADS.md: seed 0, 64..512 random token ids), one per client; every
request asks for `--max-tokens` tokens, greedy, `ignore_eos`, so the batch produces exactly
clients x max_tokens tokens (checked).

Configurations:
  in-process  `AsyncEngine.start(max_num_seqs=N)` in this process (engine core in this event loop, trio),
              N concurrent `engine.generate` tasks; each output is a delta of one or more tokens.
  HTTP        `python -m asyncengine serve --max-num-seqs N` as a subprocess (engine core in its own
              process, serve's default), N concurrent streaming POST /v1/completions through the official
              `openai` AsyncOpenAI client on asyncio, `stream_options.include_usage` for the token totals.
              The server is stopped with SIGTERM and must exit 0.
One warm-up (two short requests) before each measured batch.

Figures: output tokens over the wall time of the batch (first submit to last finish); time to first token
(from a client's submit to its first chunk that carries text, or for in-process its first output with
tokens); inter-token latency, measured as the gap between successive such chunks (outputs), pooled over
all clients. A chunk can carry several tokens when the engine merges deltas for a consumer that falls
behind; we do not divide the gap by them (HTTP chunks carry no token counts), so "ITL" is the gap between
deliveries, and the tokens per delivery are reported beside it. For HTTP the client's CPU seconds during
the batch are reported too: on a 2-core machine it competes with the server for the cores.
Prints one summary line per configuration and the ratio of HTTP to in-process throughput (goal: >= 0.90);
`--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import WORKLOADS, draw_workload  # noqa: E402

_SERVING = re.compile(r"^asyncengine: serving (.*) on (http://\S+)$", re.MULTILINE)


class Timings:
    """One client's record: its submit time, the arrival of each delivery that carried tokens, its total."""

    def __init__(self) -> None:
        self.submit = time.perf_counter()
        self.arrivals: list[float] = []
        self.tokens = 0
        self.empty = 0  # HTTP chunks with a choice but no text (a partial character): not deliveries

    def delivered(self) -> None:
        self.arrivals.append(time.perf_counter())


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; enough for thousands of samples."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] if ordered else float("nan")


def summarize(records: list[Timings], elapsed: float, **extra) -> dict:
    ttft = [1000 * (r.arrivals[0] - r.submit) for r in records if r.arrivals]
    itl = [1000 * (b - a) for r in records for a, b in zip(r.arrivals, r.arrivals[1:])]
    tokens = sum(r.tokens for r in records)
    deliveries = sum(len(r.arrivals) for r in records)
    return {
        "output_tokens": tokens, "seconds": round(elapsed, 3), "tok_s": round(tokens / elapsed, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "itl_p50_ms": round(percentile(itl, 50), 1), "itl_p99_ms": round(percentile(itl, 99), 1),
        "deliveries": deliveries, "tokens_per_delivery": round(tokens / max(1, deliveries), 2), **extra,
    }


# -- in-process ----------------------------------------------------------------------------------------


async def run_in_process(args, prompts: list[list[int]]) -> dict:
    from asyncengine import SamplingParams
    from asyncengine.frontend.async_engine import AsyncEngine

    async with AsyncEngine.start(model=args.model, max_num_seqs=args.num_clients) as engine:
        async def one(prompt: list[int], max_tokens: int, records: list[Timings]) -> None:
            record = Timings()
            records.append(record)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for output in engine.generate({"prompt_token_ids": prompt}, params):
                new = len(output.outputs[0].token_ids)  # a delta: the tokens since the previous output
                if new:
                    record.delivered()
                    record.tokens += new

        async def batch(prompts: list[list[int]], max_tokens: int) -> tuple[list[Timings], float]:
            records: list[Timings] = []
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt, max_tokens, records)
            return records, time.perf_counter() - start

        await batch(prompts[:2], 8)  # warm-up
        records, elapsed = await batch(prompts, args.max_tokens)
    return summarize(records, elapsed)


# -- HTTP ----------------------------------------------------------------------------------------------


def start_server(model: str | None, options: list[str], directory: Path) -> tuple[subprocess.Popen, str, str]:
    """`asyncengine serve [MODEL] OPTIONS` on a free port; returns once it printed its address (the process,
    URL, model name)."""
    return launch_server([*([model] if model else []), *options], directory)


def launch_server(serve_args: list[str], directory: Path) -> tuple[subprocess.Popen, str, str]:
    """`asyncengine serve SERVE_ARGS --port 0`, its output in `directory`; returns once it printed its address
    (the process, URL, model name)."""
    command = [sys.executable, "-m", "asyncengine", "serve", *serve_args, "--port", "0"]
    stdout_path, stderr_path = directory / "stdout", directory / "stderr"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = _SERVING.search(stdout_path.read_text())
        if match:
            return process, match.group(2), match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"the server did not start; stderr:\n{stderr_path.read_text(errors='replace')[-3000:]}")


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM, and the exit code (killed when it has not exited 60 s later)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


async def run_http_clients(args, prompts: list[list[int]], url: str, name: str) -> dict:
    import openai

    # One client (one connection pool) shared by every task, as an application would; max_retries=0 so a
    # failure shows instead of being retried into the timings.
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def one(prompt: list[int], max_tokens: int, records: list[Timings]) -> None:
            record = Timings()
            records.append(record)
            stream = await client.completions.create(
                model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    record.delivered()
                elif chunk.choices:
                    record.empty += 1
                if chunk.usage is not None:  # the last chunk, with no choices
                    record.tokens = chunk.usage.completion_tokens

        async def batch(prompts: list[list[int]], max_tokens: int) -> tuple[list[Timings], float, float]:
            records: list[Timings] = []
            start, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(one(prompt, max_tokens, records) for prompt in prompts))
            return records, time.perf_counter() - start, time.process_time() - cpu

        await batch(prompts[:2], 8)  # warm-up
        records, elapsed, client_cpu = await batch(prompts, args.max_tokens)
    return summarize(records, elapsed, client_cpu_s=round(client_cpu, 2),
                     empty_text_chunks=sum(r.empty for r in records))


def run_http(args, prompts: list[list[int]]) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="asyncengine-serve-bench-"))
    process, url, name = start_server(args.model, ["--max-num-seqs", str(args.num_clients)], directory)
    try:
        result = asyncio.run(run_http_clients(args, prompts, url, name))
    finally:
        code = stop_server(process)
    if code != 0:
        stderr = (directory / "stderr").read_text(errors="replace")
        raise RuntimeError(f"the server exited with {code} after SIGTERM; stderr:\n{stderr[-3000:]}")
    return result


# -- main ----------------------------------------------------------------------------------------------


def line(name: str, r: dict) -> str:
    text = (f"w4 {name}: {r['tok_s']:.1f} tok/s ({r['seconds']:.1f} s, {r['output_tokens']} tokens) | "
            f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms | "
            f"ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms | "
            f"{r['tokens_per_delivery']:.2f} tokens per delivery")
    if "client_cpu_s" in r:
        text += f" | client CPU {r['client_cpu_s']:.1f} s"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    _, lo, hi, out_lo, out_hi = WORKLOADS["w3"]
    prompts, _ = draw_workload(args.num_clients, lo, hi, out_lo, out_hi)  # W3's prompts; its lengths unused
    expected = args.num_clients * args.max_tokens
    results = {}
    for name, run in (("in-process", lambda: anyio.run(run_in_process, args, prompts, backend="trio")),
                      ("HTTP", lambda: run_http(args, prompts))):
        result = run()
        if result["output_tokens"] != expected:
            print(f"error: {name} generated {result['output_tokens']} tokens, expected {expected}", file=sys.stderr)
            return 1
        results[name] = result
        print(line(name, result), flush=True)
    ratio = results["HTTP"]["tok_s"] / results["in-process"]["tok_s"]
    print(f"w4 HTTP / in-process throughput: {ratio:.3f} (goal >= 0.90) | {args.num_clients} clients, "
          f"{args.max_tokens} tokens each, {sum(map(len, prompts))} prompt tokens")
    if args.json:
        summary = {"num_clients": args.num_clients, "max_tokens": args.max_tokens, "ratio": round(ratio, 3)}
        Path(args.json).write_text(json.dumps({**summary, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
