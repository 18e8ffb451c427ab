"""Tensor, pipeline and data parallelism on one workload, measured in the same run, and PP's bubble.

    python bench/distributed.py                  # W3 (32 requests, default model): TP=1, TP=2, PP=2, DP=2
    python bench/distributed.py --num-seqs 8     # a quicker, smaller draw
    python bench/distributed.py --only 0 2       # some of the configurations

Every request is submitted at once through AsyncEngine (greedy, ignore_eos); the figure is output
tokens over the wall time of the batch, after a warm-up. On this 2-core CPU the four configurations
share the same two cores, so none can be faster than TP=1 by more than what it overlaps: the figures
show the cost of each kind of parallelism here, not what it buys on several devices or hosts.

PP's bubble, per rank, from a worker extension defined here: `busy` is the time in execute_model, of it
`waited` the seconds spent on the other stage (sending activations to it, receiving them, or the last
stage's sampled tokens: asyncengine/parallel_state.py). Idle = 1 - (busy - waited) / wall time of the
batch: the fraction of the batch the rank computed nothing (waits inside a step, and the time between
steps). "PP=2" has no micro-batches (ASYNCENGINE_PIPELINE_MICRO_BATCHES=0): a step runs through stage 0, then stage 1, so each
idles about half the time; "PP=2 micro-batches" keeps two in flight (the default; =1,
engine_core/micro_batches.py), each with half the running requests, so the stages overlap.

The machine may be loaded by other work: the script prints `uptime` before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import WORKLOADS, draw_workload  # noqa: E402

CONFIGURATIONS = [
    ("TP=1", dict()),
    ("TP=2", dict(tensor_parallel_size=2)),
    ("PP=2", dict(pipeline_parallel_size=2, worker_extension_cls="distributed:PipelineProbe",
                  env={"ASYNCENGINE_PIPELINE_MICRO_BATCHES": "0"})),
    ("PP=2 micro-batches", dict(pipeline_parallel_size=2, worker_extension_cls="distributed:PipelineProbe",
                                env={"ASYNCENGINE_PIPELINE_MICRO_BATCHES": "1"})),
    ("DP=2", dict(data_parallel_size=2, in_process=False)),
]


class PipelineProbe:
    """A worker extension (built as PipelineProbe(worker) in each worker): the rank's wait on other stages."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.busy = 0.0
        inner = worker.execute_model

        def timed_execute_model(scheduler_output):  # looked up on the worker at every step
            started = time.perf_counter()
            try:
                return inner(scheduler_output)
            finally:
                self.busy += time.perf_counter() - started

        worker.execute_model = timed_execute_model

    def pipeline_wait(self) -> dict:
        from asyncengine import parallel_state

        return {"rank": self.worker.rank, "stage": parallel_state.pipeline_rank(),
                "waited_s": parallel_state.pipeline_wait_seconds(), "busy_s": self.busy}


async def run_configuration(options: dict, args, prompts, max_tokens) -> dict:
    options = dict(options)
    env = options.pop("env", {})
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # read by the engine core (its own process inherits them)
    try:
        return await measure(dict(model=args.model, skip_tokenizer_init=True, dtype="float32", **options),
                             prompts, max_tokens)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def measure(config: dict, prompts, max_tokens) -> dict:
    from asyncengine import AsyncEngine, SamplingParams

    async with AsyncEngine.start(**config) as engine:
        async def one(prompt, n, counts):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            async for output in engine.generate({"prompt_token_ids": prompt}, params):
                counts.append(len(output.outputs[0].token_ids))

        async def batch(items):
            counts: list[int] = []
            async with anyio.create_task_group() as tg:
                for prompt, n in items:
                    tg.start_soon(one, prompt, n, counts)
            return sum(counts)

        await batch([(prompts[0], 8), (prompts[1], 8)])  # warm-up
        probe = "worker_extension_cls" in config
        waited_before = await engine.collective_rpc("pipeline_wait") if probe else []
        start = time.perf_counter()
        generated = await batch(list(zip(prompts, max_tokens)))
        elapsed = time.perf_counter() - start
        waited_after = await engine.collective_rpc("pipeline_wait") if probe else []
    result = {"output_tokens": generated, "seconds": round(elapsed, 2), "tok_s": round(generated / elapsed, 2)}
    if probe:
        result["bubble"] = []
        for before, after in zip(waited_before, waited_after):
            waited = after["waited_s"] - before["waited_s"]
            busy = after["busy_s"] - before["busy_s"]
            result["bubble"].append({"rank": after["rank"], "stage": after["stage"],
                                     "waited_fraction": round(waited / elapsed, 3),
                                     "idle_fraction": round(1 - (busy - waited) / elapsed, 3)})
    return result


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w3")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--model", default=None)
    parser.add_argument("--only", type=int, nargs="*", help="indices of the configurations to run")
    parser.add_argument("--json")
    args = parser.parse_args()
    # The probe extension is imported by each worker process: they inherit this PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    num_seqs, lo, hi, out_lo, out_hi = WORKLOADS[args.workload]
    prompts, max_tokens = draw_workload(args.num_seqs or num_seqs, lo, hi, out_lo, out_hi)
    print(f"uptime before: {uptime()}", flush=True)
    results = {}
    chosen = [CONFIGURATIONS[i] for i in args.only] if args.only else CONFIGURATIONS
    for name, options in chosen:
        result = anyio.run(run_configuration, options, args, prompts, max_tokens, backend="trio")
        if result["output_tokens"] != sum(max_tokens):
            print(f"error: {name} generated {result['output_tokens']} tokens, expected {sum(max_tokens)}")
            return 1
        results[name] = result
        bubble = "".join(f", stage {b['stage']} idle {100 * b['idle_fraction']:.0f}% (waited on the other "
                         f"{100 * b['waited_fraction']:.0f}%)" for b in result.get("bubble", []))
        print(f"{args.workload} {name}: {result['tok_s']:.1f} tok/s ({result['seconds']:.1f} s, "
              f"{result['output_tokens']} tokens){bubble}", flush=True)
    print(f"uptime after: {uptime()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
