"""A speculative verification step on the default model, as the engine ran it before and runs it now (issue 37).

    .venv/bin/python bench/verify_step.py                      # bfloat16, 1 + 4 drafts, context 600
    .venv/bin/python bench/verify_step.py --dtype float32 --new-tokens 6

One request at a context of `--context` tokens (random ids: the timing does not depend on them) in the engine's
ModelRunner: the decode step (one token, the one-call C step), its verification step (its last token and
`--new-tokens - 1` drafts) through the model's modules (the path it took before) and through the one-call step,
each up to its logits for every row; rounds alternate A B C A B C. It prints each round's ms per step, the
medians, and what a step of verification costs over a decode step both ways: with the mean acceptance length m of
bench/spec_decode.py, the forward passes alone bound the speedup by m / that cost. The step without the engine
around it (scheduling, sampling, the proposer: bench/spec_decode.py --speed has them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

BLOCK_SIZE = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=5, help="the verification's rows: 1 + drafts (2-8)")
    parser.add_argument("--context", type=int, default=600, help="the request's context after the step")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from asyncengine import EngineConfig
    from asyncengine.config.model import build_model_config
    from asyncengine.loader.model_source import resolve_model_dir
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.plugin_runtime import platform_resolution
    from asyncengine.plugin_runtime.records import StartupTrace
    from asyncengine.wire.engine_core import SamplingOptions
    from asyncengine.wire.worker import NewRequestData, SchedulerOutput
    from asyncengine.worker.model_runner import ModelRunner

    platform_resolution.set_current_platform(CpuPlatform)
    path = resolve_model_dir(None, progress=False)
    config = EngineConfig(model=str(path), dtype=args.dtype, skip_tokenizer_init=True, max_model_len=args.context + 16,
                          num_gpu_blocks_override=-(-args.context // BLOCK_SIZE) + 8, block_size=BLOCK_SIZE,
                          max_num_seqs=8, plugins="")
    model_config = build_model_config(config, model_dir=path, default_dtype="float32", tokenizer=None)
    StartupTrace("frontend")
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    if runner.cpu_decode is None:
        raise SystemExit(f"the one-call step does not apply: {[r.reason for r in runner.kv_cache_records]}")
    generator = torch.Generator().manual_seed(0)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.copy_(torch.randn(key_cache.shape, generator=generator) * 0.5)
        value_cache.copy_(torch.randn(value_cache.shape, generator=generator) * 0.5)

    def inputs(new_tokens: int):
        request = f"request-{new_tokens}"
        prompt = torch.randint(3, 10000, (args.context,), generator=generator).tolist()
        runner._update_states(SchedulerOutput(new_requests=[NewRequestData(
            request_id=request, prompt_token_ids=prompt, output_token_ids=[],
            sampling=SamplingOptions(temperature=0.0), block_ids=list(range(-(-args.context // BLOCK_SIZE))),
            num_computed_tokens=args.context - new_tokens)]))
        prepared = runner._prepare_inputs({request: new_tokens})
        runner._remove_request(request)
        return prepared

    decode, verify = inputs(1), inputs(args.new_tokens)

    def modules():
        hidden = runner.model(verify.input_ids, verify.positions, verify.metadata)
        return runner.model.compute_logits(hidden)

    steps = {"decode step, C": lambda: runner.cpu_decode.run(decode.input_ids, decode.positions, decode.metadata)[1],
             f"verify {args.new_tokens}, modules": modules,
             f"verify {args.new_tokens}, C": lambda: runner.cpu_decode.run(verify.input_ids, verify.positions,
                                                                          verify.metadata)[1]}
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        for step in steps.values():
            step()  # warm
        for _ in range(args.rounds):
            for name, step in steps.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append(1000 * (time.perf_counter() - started) / args.steps)
    print(f"default model, {args.dtype}, context {args.context}, {torch.get_num_threads()} thread(s), "
          f"load {open('/proc/loadavg').read().split()[0]}")
    base = statistics.median(times["decode step, C"])
    for name, into in times.items():
        print(f"{name:22s} ms/step " + " ".join(f"{t:.2f}" for t in into)
              + f"  median {statistics.median(into):.2f} (x{statistics.median(into) / base:.2f} a decode step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
