"""Soak: a mixed workload against `asyncengine serve` for a set time, watching both processes' memory (issue 30).

    python bench/soak.py                          # 10 minutes, 16 workers, the default model
    python bench/soak.py --seconds 180            # a quicker look
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234    # a server you started (its frontend's PID)

The server is `asyncengine serve` as a subprocess (the engine core in its own process, serve's default), on
the default model unless `--model` says otherwise; `--server-arg` passes more flags. The generation model also
answers /v1/embeddings (its last token), so one server serves the whole mix.

Each of `--workers` (16) loops until the time is up, drawing its next request (seeded, `--seed`) from:
  chat             /v1/chat/completions, 8-48 tokens
  chat-stream      the same streamed, with `stream_options.include_usage`
  completion       /v1/completions, n 1 or 2, 8-48 tokens
  completion-stream  the same streamed
  structured       chat with `response_format` json_schema, one of 8 small schemas (so that the compiled-grammar
                   cache holds 8 entries at most: a growing cache is issue 30's item 2, not this soak's subject)
  embeddings       /v1/embeddings, 1-4 inputs
  disconnect       a chat stream of 256 tokens that the client closes after its second chunk
Prompts are drawn from a word list (random lengths, 5-200 words), so the prefix cache sees both repeats and
new text.

Every 10 s it prints the frontend's and the engine core's RSS (the server process, and its child that runs
`asyncengine.engine_core.process`) and, in brackets, the anonymous part of it (RssAnon: the process's own heap
and mappings; the rest is file pages, code and libraries, which the kernel drops and reloads under memory
pressure from other processes, so RSS alone can fall and rise by tens of MB without the process doing
anything), the requests done and the errors. At the end, one summary line: for each process, RSS (and RssAnon)
at the end of the first minute and the largest rise above it afterwards, which must stay within `--tolerance`
(5%) for the soak to pass (exit 0; else 1); the largest fall is shown too. Errors are counted by kind and
status; an error other than a 503 `engine_overloaded` fails the soak too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import launch_server, stop_server  # noqa: E402

_WORDS = ("river mountain quiet engine yellow window paper garden silver number morning story castle "
          "ocean forest letter market bridge winter summer planet signal travel doctor school music "
          "kitchen animal family orange circle memory machine thunder village lantern harbor").split()
KINDS = ["chat", "chat-stream", "completion", "completion-stream", "structured", "embeddings", "disconnect"]
SCHEMAS = [
    {"type": "object", "properties": {name: {"type": kind} for name, kind in props}, "required": [props[0][0]]}
    for props in ([("name", "string")], [("age", "integer")], [("ok", "boolean")], [("city", "string"),
                  ("zip", "integer")], [("title", "string"), ("year", "integer")], [("x", "number"), ("y", "number")],
                  [("tags", "string")], [("color", "string"), ("bright", "boolean")])
]


@dataclass
class Tally:
    done: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    error_samples: list[str] = field(default_factory=list)

    def failed(self, kind: str, error: BaseException) -> None:
        status = getattr(error, "status_code", None)
        code = None
        body = getattr(error, "body", None)
        if isinstance(body, dict):
            code = body.get("code")
        key = f"{kind}:{status or type(error).__name__}{':' + code if code else ''}"
        self.errors[key] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{key}: {str(error)[:300]}")

    def serious_errors(self) -> int:
        return sum(count for key, count in self.errors.items() if not key.endswith(":503:engine_overloaded"))


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 200)))


async def one_request(client, model: str, kind: str, rng: random.Random) -> None:
    text = prompt_text(rng)
    messages = [{"role": "user", "content": text}]
    tokens = rng.randint(8, 48)
    if kind == "chat":
        await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens)
    elif kind == "chat-stream":
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, stream=True,
                                                      stream_options={"include_usage": True})
        async for _ in stream:
            pass
    elif kind == "completion":
        await client.completions.create(model=model, prompt=text, max_tokens=tokens, n=rng.choice([1, 2]))
    elif kind == "completion-stream":
        stream = await client.completions.create(model=model, prompt=text, max_tokens=tokens, stream=True)
        async for _ in stream:
            pass
    elif kind == "structured":
        schema = rng.choice(SCHEMAS)
        await client.chat.completions.create(
            model=model, messages=messages, max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    elif kind == "embeddings":
        await client.embeddings.create(model=model, input=[prompt_text(rng) for _ in range(rng.randint(1, 4))])
    elif kind == "disconnect":
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=256, stream=True)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                break
        await stream.close()  # the connection goes: the server aborts the request
    else:
        raise ValueError(kind)


async def worker(index: int, client, model: str, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + index)
    while time.monotonic() < deadline:
        kind = rng.choice(KINDS)
        try:
            await one_request(client, model, kind, rng)
            tally.done[kind] += 1
        except Exception as error:  # counted and reported by kind and status; the soak goes on
            tally.failed(kind, error)


def server_processes(frontend_pid: int) -> tuple[psutil.Process, psutil.Process]:
    frontend = psutil.Process(frontend_pid)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in frontend.children(recursive=True):
            try:
                if "asyncengine.engine_core.process" in " ".join(child.cmdline()):
                    return frontend, child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.5)
    raise RuntimeError(f"no engine-core child (asyncengine.engine_core.process) under PID {frontend_pid}: the "
                       "soak needs the engine core in its own process (serve's default)")


def memory_mb(process: psutil.Process) -> tuple[float, float]:
    """(RSS, RssAnon) in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{process.pid}/status"))
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon"))  # type: ignore[return-value]


Sample = tuple[float, float, float, float, float]  # seconds, frontend RSS, its RssAnon, engine-core RSS, RssAnon


def sample_now(started: float, frontend: psutil.Process, engine: psutil.Process) -> Sample:
    return (time.monotonic() - started, *memory_mb(frontend), *memory_mb(engine))


async def monitor(frontend: psutil.Process, engine: psutil.Process, started: float, deadline: float,
                  tally: Tally, samples: list[Sample], interval: float) -> None:
    while True:
        sample = sample_now(started, frontend, engine)
        samples.append(sample)
        print(f"t={sample[0]:6.0f} s  frontend {sample[1]:7.1f} MB ({sample[2]:7.1f})  engine core {sample[3]:7.1f} "
              f"MB ({sample[4]:7.1f})  requests {sum(tally.done.values()):6d}  errors {sum(tally.errors.values())}",
              flush=True)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def drift(samples: list[Sample], column: int, after: float) -> tuple[float, float, float, float]:
    """(the value at `after` s, its largest rise and largest fall later on in percent, the value at the end)."""
    later = [s for s in samples if s[0] >= after] or samples[-1:]
    base = later[0][column]
    rise = max((s[column] - base) / base * 100 for s in later)
    fall = max((base - s[column]) / base * 100 for s in later)
    return base, rise, fall, later[-1][column]


def describe(name: str, rss: tuple[float, float, float, float], anon: tuple[float, float, float, float]) -> str:
    return (f"{name} {rss[0]:.0f} -> {rss[3]:.0f} MB (rise at most {rss[1]:.1f}%, fall {rss[2]:.1f}%; "
            f"anon {anon[0]:.0f} -> {anon[3]:.0f}, rise {anon[1]:.1f}%)")


async def soak(args, url: str, model: str, frontend_pid: int) -> int:
    import openai

    frontend, engine = server_processes(frontend_pid)
    tally = Tally()
    samples: list[Sample] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=900) as client:
        await client.completions.create(model=model, prompt="Hello", max_tokens=4)  # warm-up
        started = time.monotonic()
        deadline = started + args.seconds
        await asyncio.gather(monitor(frontend, engine, started, deadline, tally, samples, args.interval),
                             *(worker(i, client, model, deadline, args.seed, tally) for i in range(args.workers)))
        # the workers finished their last requests past the deadline: one more sample, at rest
        samples.append(sample_now(started, frontend, engine))
    front, front_anon, core, core_anon = (drift(samples, column, args.warmup) for column in (1, 2, 3, 4))
    flat = all(d[1] <= args.tolerance for d in (front, front_anon, core, core_anon))
    requests = sum(tally.done.values())
    print(f"soak: {args.seconds:.0f} s, {args.workers} workers, {requests} requests "
          f"({', '.join(f'{k} {tally.done[k]}' for k in KINDS)}), errors {dict(tally.errors) or 0}; "
          f"RSS from t={args.warmup:.0f} s: {describe('frontend', front, front_anon)}, "
          f"{describe('engine core', core, core_anon)}; {'flat' if flat else 'NOT flat'} within "
          f"{args.tolerance:g}%", flush=True)
    for sample in tally.error_samples:
        print("  error:", sample)
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "done": tally.done, "errors": tally.errors,
                                               "frontend": front, "engine_core": core, "flat": flat}, indent=1))
    return 0 if flat and tally.serious_errors() == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--interval", type=float, default=10, help="seconds between RSS lines")
    parser.add_argument("--warmup", type=float, default=60, help="RSS must stay flat from this many seconds on")
    parser.add_argument("--tolerance", type=float, default=5.0, help="percent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--server-arg", action="append", default=[], help="one more `serve` argument (repeat)")
    parser.add_argument("--url", default=None, help="soak a running server instead (give --pid and --model-name)")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the server's (frontend's) PID")
    parser.add_argument("--model-name", default=None, help="with --url: the served model name")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--json", default=None, help="write the samples and counts to this file")
    args = parser.parse_args()
    if args.url:
        if args.pid is None or args.model_name is None:
            parser.error("--url needs --pid and --model-name")
        return asyncio.run(soak(args, args.url, args.model_name, args.pid))
    directory = Path(tempfile.mkdtemp(prefix="asyncengine-soak-"))
    process, url, model = launch_server([*([args.model] if args.model else []), *args.server_arg], directory)
    print(f"server PID {process.pid} on {url}, model {model}; logs in {directory}", flush=True)
    try:
        code = asyncio.run(soak(args, url, model, process.pid))
    finally:
        exit_code = stop_server(process)
    if exit_code != 0:
        print(f"the server exited with {exit_code} after SIGTERM; its logs: {directory}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
