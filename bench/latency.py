"""W5: one stream's latency (WORKLOADS.md): time to first token, decode rate and inter-token latency.

    .venv/bin/python bench/latency.py                        # 1 and 4 requests, asyncengine and llama.cpp
    .venv/bin/python bench/latency.py --contention           # the same with a CPU hog on one core
    .venv/bin/python bench/latency.py --baseline-tree /tmp/main --rounds 2   # ABAB against another tree's code
    .venv/bin/python bench/latency.py --quantization gguf    # the default model's Q4_1 GGUF, both engines
    .venv/bin/python bench/latency.py --model gemma-3-270m-Q4_K_M --quantization gguf   # Gemma 3 270M's file
    .venv/bin/python bench/latency.py --requests 1 --max-tokens 16 --prompt-lens 64 256 512 1024 2048   # TTFT sweep

Each request is W3's first prompt (496 tokens), shifted by a different offset on every request so no prompt is
ever a prefix-cache hit, greedy, 256 output tokens (ignore_eos). A run submits `n` requests at once and
records when each token arrived: TTFT (submission to first token), each stream's decode rate (its tokens
after the first over the time from the first to the last) and the inter-token gaps (p50, p99 over every gap
of every stream). One warm-up request before the measured ones. `--prompt-lens` runs the same with prompts
of other lengths (W3's first prompt repeated to length, shifted the same way): time to first token from 64 to
2,048 prompt tokens, never a cache hit.

asyncengine: an in-process AsyncEngine (`--model`, else the default model; `--dtype`, `--quantization`,
`--cpu-threads`),
run in a fresh child process per measurement (this file with `--child`), so that each starts clean and
`--baseline-tree DIR` can run the same measurement on DIR's code (PYTHONPATH=DIR) alternately with this
tree's: A B A B in one run, the comparison a loaded machine allows.
llama.cpp: `llama-server` (bench/llama_server.py; skipped, saying so, when it is not built) on the default
model's GGUF at the engine's precision (F32, BF16; with `--quantization gguf` its Q4_1 file), or on `--model`'s
GGUF file as it is (a packaged model such as gemma-3-270m-Q4_K_M, or a .gguf path), one slot per request, the
engine's thread count, streamed; twice: with its default KV cache (f16) and with the cache at the engine's
dtype (the precision of the engine's KV cache, whatever the weights' quantization).

`--contention`: a busy loop pinned to the last CPU this process may use runs from before each engine starts
until it stops (so an engine sees the busy core when it chooses its threads: docs/performance.md).
Every line states the load average at its start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The child takes asyncengine from PYTHONPATH (`--baseline-tree`) or the installed tree, never from this file's.
sys.path[:0] = [str(ROOT / "bench")] if sys.argv[1:2] == ["--child"] else [str(ROOT), str(ROOT / "bench")]

PROMPT_LEN = 496  # W3's first prompt


def w5_prompts(num_requests: int, run: int, prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    """W3's first prompt (repeated or cut to `prompt_len`), shifted per request and per run: never a prefix-cache
    hit."""
    from throughput import WORKLOADS, draw_workload

    first = draw_workload(*WORKLOADS["w3"])[0][0]
    base = (first * (prompt_len // len(first) + 1))[:prompt_len]
    return [[(t + 1 + 97 * (run * 8 + i)) % 10000 for t in base] for i in range(num_requests)]


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def summarize(streams: list[tuple[float, list[tuple[float, int]]]]) -> dict:
    """From each stream's (submit time, [(arrival time, tokens in that output)])."""
    ttfts, rates, gaps, tokens = [], [], [], 0
    for submitted, arrivals in streams:
        ttfts.append(arrivals[0][0] - submitted)
        count = sum(n for _, n in arrivals)
        tokens += count
        if len(arrivals) > 1 and arrivals[-1][0] > arrivals[0][0]:
            rates.append((count - arrivals[0][1]) / (arrivals[-1][0] - arrivals[0][0]))
        for (before, _), (after, n) in zip(arrivals, arrivals[1:]):
            gaps.extend([(after - before) / n] * n)
    gaps.sort()

    def pct(p: float) -> float:
        return 1000 * gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else float("nan")

    return {"ttft_ms": 1000 * statistics.mean(ttfts), "decode_tok_s": statistics.mean(rates) if rates else 0.0,
            "itl_p50_ms": pct(0.5), "itl_p99_ms": pct(0.99), "tokens": tokens}


# -- asyncengine (in a child process) -------------------------------------------------------------------


def child(options: dict, num_requests: int, max_tokens: int, run: int, prompt_len: int) -> dict:
    import anyio

    from asyncengine import AsyncEngine, EngineConfig, SamplingParams

    async def main() -> dict:
        config = EngineConfig(**options)
        async with AsyncEngine.start(config) as engine:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)

            async def one(prompt: list[int], into: list) -> None:
                submitted, arrivals = time.perf_counter(), []
                async for out in engine.generate({"prompt_token_ids": prompt}, params):
                    if out.outputs and out.outputs[0].token_ids:
                        arrivals.append((time.perf_counter(), len(out.outputs[0].token_ids)))
                into.append((submitted, arrivals))

            warm: list = []
            await one([(t + 5000) % 10000 for t in w5_prompts(1, run, prompt_len)[0]], warm)
            threads = ((await engine.collective_rpc("describe"))[0].get("cpu_threads") or {}).get("threads")
            streams: list = []
            async with anyio.create_task_group() as tg:
                for prompt in w5_prompts(num_requests, run, prompt_len):
                    tg.start_soon(one, prompt, streams)
            return {**summarize(streams), "threads": threads}

    import asyncengine
    import asyncengine.ops

    # Both said: the engine's code and the kernels it ran (an editable install once gave a baseline tree main's ops)
    return {**anyio.run(main, backend="trio"), "code": str(Path(asyncengine.__file__).resolve().parent.parent),
            "ops": str(Path(asyncengine.ops.__file__).resolve().parent)}


def run_asyncengine(args, num_requests: int, run: int, tree: Path | None, prompt_len: int) -> dict:
    max_model_len = max(1024, prompt_len + args.max_tokens + 16)
    options = dict(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, quantization=args.quantization,
                   cpu_threads=args.cpu_threads, max_model_len=max_model_len,
                   # every stream's whole context at 48 KiB a token (the default model's float32 KV: 46 KiB)
                   kv_cache_memory_bytes=max(64 * 2**20, num_requests * max_model_len * 48 * 2**10),
                   max_num_seqs=max(4, num_requests), plugins="")
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(Path(__file__).resolve()), "--child",
               json.dumps({"options": options, "n": num_requests, "max_tokens": args.max_tokens, "run": run,
                           "prompt_len": prompt_len})]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=str(tree or ROOT))
    if result.returncode != 0:
        raise RuntimeError(f"the asyncengine child failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- llama.cpp ------------------------------------------------------------------------------------------


def run_llama(args, num_requests: int, run: int, kv_type: str | None, threads: int, prompt_len: int) -> dict:
    import llama_server
    from throughput import model_gguf_file

    model = model_gguf_file(args.model)
    if model is None:
        gguf_type = llama_server.GGUF_TYPES.get(args.quantization or "", None) or \
            {"float32": "F32", "bfloat16": "BF16"}[resolved_dtype(args.dtype)]
        model = llama_server.gguf_file(gguf_type)
    server = llama_server.find_binary("llama-server")
    port = llama_server._free_port()
    command = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(num_requests),
               "-c", str(num_requests * (prompt_len + args.max_tokens + 16)), "-cb", "-kvu", "-t", str(threads),
               "-tb", str(threads), "--no-webui", "-cram", "0"]
    if kv_type is not None:
        command += ["-ctk", kv_type, "-ctv", kv_type]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise llama_server.Unavailable(f"llama-server did not start: {' '.join(command)}")
            time.sleep(0.5)

        def one(prompt: list[int]) -> tuple[float, list[tuple[float, int]]]:
            body = {"prompt": prompt, "n_predict": args.max_tokens, "ignore_eos": True, "temperature": 0.0,
                    "cache_prompt": False, "samplers": ["top_k"], "top_k": 1, "stream": True}
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            submitted, arrivals = time.perf_counter(), []
            connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            for line in response:
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if event.get("stop"):
                        break
                    arrivals.append((time.perf_counter(), 1))
            connection.close()
            return submitted, arrivals

        one([(t + 5000) % 10000 for t in w5_prompts(1, run)[0]][:64])  # warm-up
        with ThreadPoolExecutor(max_workers=num_requests) as pool:
            streams = list(pool.map(one, w5_prompts(num_requests, run, prompt_len)))
        return {**summarize(streams), "threads": threads}
    finally:
        llama_server.stop_server(process)


def _healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        ok = connection.getresponse().status == 200
        connection.close()
        return ok
    except OSError:
        return False


def resolved_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    from asyncengine.platforms.cpu import cpu_auto_dtype

    return cpu_auto_dtype()


@contextmanager
def hog(enabled: bool):
    """A busy loop pinned to the last CPU this process may use, for the duration."""
    if not enabled:
        yield None
        return
    cpu = max(os.sched_getaffinity(0))
    process = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    time.sleep(1.0)  # running, and counted busy, before anything starts
    try:
        yield cpu
    finally:
        process.kill()
        process.wait()


def label(prompt_len: int, num_requests: int) -> str:
    return f"{num_requests} req" + ("" if prompt_len == PROMPT_LEN else f" x {prompt_len} tok")


def line(name: str, figures: dict, started_load: str) -> str:
    return (f"{name:44s} TTFT {figures['ttft_ms']:7.1f} ms  decode {figures['decode_tok_s']:6.1f} tok/s/stream  "
            f"ITL p50 {figures['itl_p50_ms']:6.1f} ms p99 {figures['itl_p99_ms']:6.1f} ms  "
            f"threads {figures.get('threads')}  (load {started_load})"
            + (f"  code {figures['code']} ops {figures.get('ops')}" if "code" in figures else ""))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        print(json.dumps(child(spec["options"], spec["n"], spec["max_tokens"], spec["run"],
                               spec.get("prompt_len", PROMPT_LEN))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a packaged model's name or a path (default: the default model)")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[PROMPT_LEN],
                        help="prompt lengths to run (default: W5's 496)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--contention", action="store_true", help="a busy loop on one core throughout")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every measurement, alternating")
    parser.add_argument("--baseline-tree", type=Path, help="also run asyncengine from this tree's code (ABAB)")
    parser.add_argument("--no-llama", action="store_true", help="asyncengine only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import llama_server

    llama = not args.no_llama
    if llama:
        try:
            llama_server.find_binary("llama-server")
        except llama_server.Unavailable as exc:
            print(f"llama.cpp: {exc}; asyncengine alone")
            llama = False
    print(f"W5, model {args.model or 'the default'}, {args.max_tokens} output tokens, prompts of "
          f"{', '.join(map(str, args.prompt_lens))} tokens, "
          f"dtype {args.dtype}, quantization "
          f"{args.quantization}, {'with a CPU hog on one core' if args.contention else 'no hog'}; "
          f"{len(os.sched_getaffinity(0))} CPUs; load {load()}")
    results: list[dict] = []
    for prompt_len, num_requests in [(p, n) for p in args.prompt_lens for n in args.requests]:
        for run in range(args.rounds):
            variants: list[tuple[str, Path | None]] = [("asyncengine", None)]
            if args.baseline_tree is not None:
                variants.append((f"asyncengine@{args.baseline_tree}", args.baseline_tree))
            for name, tree in variants:
                started = load()
                with hog(args.contention):
                    figures = run_asyncengine(args, num_requests, run, tree, prompt_len)
                print(line(f"{name}, {label(prompt_len, num_requests)}, round {run + 1}", figures, started),
                      flush=True)
                results.append({"engine": name, "requests": num_requests, "prompt_len": prompt_len,
                                "round": run + 1, "load": started, **figures})
            if llama:
                threads = args.cpu_threads or min(len(os.sched_getaffinity(0)), os.cpu_count() or 1)
                precision = {"float32": "f32", "bfloat16": "bf16"}.get(resolved_dtype(args.dtype))
                for kv in dict.fromkeys((None, precision)):  # the default (f16), then the engine's dtype
                    name = f"llama.cpp KV {kv or 'f16 (default)'}"
                    started = load()
                    with hog(args.contention):
                        figures = run_llama(args, num_requests, run, kv, threads, prompt_len)
                    print(line(f"{name}, {label(prompt_len, num_requests)}, round {run + 1}", figures, started),
                          flush=True)
                    results.append({"engine": name, "requests": num_requests, "prompt_len": prompt_len,
                                    "round": run + 1, "load": started, **figures})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
