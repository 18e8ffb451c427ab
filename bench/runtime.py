"""Runtime placements and async scheduling on one workload, measured in the same run.

    python bench/runtime.py                 # W3 (32 requests, default model) in four configurations
    python bench/runtime.py --num-seqs 8    # a quicker, smaller draw
    python bench/runtime.py --random-model small   # millisecond steps: where the overheads show

Configurations: the engine core in this event loop (worker in a thread) or in its own process (with
its worker in a process of its own, `mp`), each with async scheduling on and off. Every request is
submitted at once through AsyncEngine; the figure is output tokens over the wall time of the batch,
after a warm-up. The engine core's step trace gives, per configuration, how often step N+1 was
scheduled before step N finished executing, and how much of the time the worker sat idle between
steps. One summary line per configuration, then a few trace lines; `--json FILE` writes it all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import RANDOM_SHAPES, WORKLOADS, draw_workload, random_model_dir  # noqa: E402

CONFIGURATIONS = [
    ("in-process, async scheduling", dict(in_process=True, async_scheduling=True)),
    ("in-process, sync scheduling", dict(in_process=True, async_scheduling=False)),
    ("multiprocess (core + mp worker), async scheduling",
     dict(in_process=False, distributed_executor_backend="mp", async_scheduling=True)),
    ("multiprocess (core + mp worker), sync scheduling",
     dict(in_process=False, distributed_executor_backend="mp", async_scheduling=False)),
]


def overlap_figures(trace: list[list[float]]) -> dict:
    """From StepRecords (step, tokens, sched start/end, exec start/end, update start/end)."""
    steps = sorted(trace, key=lambda r: r[0])
    ahead = 0  # steps scheduled before the previous step finished executing
    idle = 0.0
    for previous, current in zip(steps, steps[1:]):
        if current[3] <= previous[5]:
            ahead += 1
        idle += max(0.0, current[4] - previous[5])
    busy = sum(r[5] - r[4] for r in steps)
    span = steps[-1][5] - steps[0][4] if steps else 0.0
    return {
        "steps": len(steps),
        "scheduled_ahead_fraction": round(ahead / max(1, len(steps) - 1), 3),
        "worker_idle_fraction": round(idle / span, 4) if span else 0.0,
        "worker_busy_s": round(busy, 3),
        "mean_schedule_ms": round(1000 * sum(r[3] - r[2] for r in steps) / max(1, len(steps)), 3),
        "mean_update_ms": round(1000 * sum(r[7] - r[6] for r in steps) / max(1, len(steps)), 3),
    }


async def traced_run(config: dict, prompts, max_tokens) -> tuple[int, float, list]:
    """Start an AsyncEngine with `config`, warm it up, then submit every request at once (greedy, ignore_eos) with
    the engine core's step trace on: (output tokens, seconds, the step trace as StepRecord rows)."""
    from asyncengine import SamplingParams
    from asyncengine.frontend.async_engine import AsyncEngine

    async with AsyncEngine.start(**config) as engine:
        async def one(prompt, n, counts):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            async for output in engine.generate({"prompt_token_ids": prompt}, params):
                counts.append(len(output.outputs[0].token_ids))  # each output carries the new tokens

        async def batch(items):
            counts: list[int] = []
            async with anyio.create_task_group() as tg:
                for prompt, n in items:
                    tg.start_soon(one, prompt, n, counts)
            return sum(counts)

        await batch([(prompts[0], 8), (prompts[1], 8)])  # warm-up
        await engine.call_engine_core("start_step_trace")
        start = time.perf_counter()
        generated = await batch(list(zip(prompts, max_tokens)))
        elapsed = time.perf_counter() - start
        trace = await engine.call_engine_core("stop_step_trace")
    return generated, elapsed, trace


async def run_configuration(options: dict, args, prompts, max_tokens) -> dict:
    config = dict(model=args.model, skip_tokenizer_init=True, load_format=args.load_format, **options)
    generated, elapsed, trace = await traced_run(config, prompts, max_tokens)
    return {"output_tokens": generated, "seconds": round(elapsed, 3), "tok_s": round(generated / elapsed, 2),
            **overlap_figures(trace), "trace_head": trace[5:9]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w3")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-model", choices=sorted(RANDOM_SHAPES),
                        help="random weights of this shape (`small`: millisecond steps, where overheads show)")
    parser.add_argument("--only", type=int, nargs="*", help="indices of the configurations to run")
    parser.add_argument("--json")
    args = parser.parse_args()
    num_seqs, lo, hi, out_lo, out_hi = WORKLOADS[args.workload]
    prompts, max_tokens = draw_workload(args.num_seqs or num_seqs, lo, hi, out_lo, out_hi)
    args.load_format = "auto"
    if args.random_model:
        args.model, args.load_format = random_model_dir(RANDOM_SHAPES[args.random_model], None), "dummy"
    results = {}
    chosen = [CONFIGURATIONS[i] for i in args.only] if args.only else CONFIGURATIONS
    for name, options in chosen:
        result = anyio.run(run_configuration, options, args, prompts, max_tokens, backend="trio")
        if result["output_tokens"] != sum(max_tokens):
            print(f"error: {name} generated {result['output_tokens']} tokens, expected {sum(max_tokens)}")
            return 1
        results[name] = result
        print(
            f"{args.workload} {name}: {result['tok_s']:.1f} tok/s ({result['seconds']:.1f} s, "
            f"{result['output_tokens']} tokens) | steps {result['steps']}, scheduled ahead "
            f"{100 * result['scheduled_ahead_fraction']:.0f}%, worker idle {100 * result['worker_idle_fraction']:.2f}%, "
            f"schedule {result['mean_schedule_ms']:.2f} ms, update {result['mean_update_ms']:.2f} ms per step",
            flush=True,
        )
    for name, result in results.items():
        print(f"trace ({name}): step, tokens, schedule start/end, execute start/end, update start/end (s, monotonic)")
        for record in result["trace_head"]:
            print("  " + ", ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in record))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
