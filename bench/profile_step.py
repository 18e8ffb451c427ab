"""Where one W3 decode step spends its time: the model runner on the default model, op by op (torch.profiler).

    .venv/bin/python bench/profile_step.py                   # float32, 32 decoding sequences
    .venv/bin/python bench/profile_step.py --dtype bfloat16
    .venv/bin/python bench/profile_step.py --prefill 512     # one 512-token prompt instead
    .venv/bin/python bench/profile_step.py --num-seqs 4      # a decode step late in W3, 4 sequences left

Builds a ModelRunner with the default model and fills it with W3's 32 prompts, each halfway through its
output (contexts of about 100-640 tokens, as in the middle of a W3 run), then runs the same decode step
repeatedly: the median wall time of a step, and the profiler's self time per op grouped into what the
step does (linear layers, attention, norms and rotary, the head and sampling, the rest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# op name (prefix) -> group, first match wins
GROUPS = [
    ("linear", ("aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int", "aten::matmul_int",
                "mkldnn::_linear", "mkl::_mkl_linear")),
    ("attention", ("aten::index_select", "aten::bmm", "aten::_softmax", "aten::softmax", "aten::masked_fill",
                   "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::index_copy", "aten::baddbmm",
                   "asyncengine::")),
    ("norm/rotary/act", ("aten::mul", "aten::add", "aten::rsqrt", "aten::pow", "aten::mean", "aten::silu",
                         "aten::cat", "aten::neg", "aten::_to_copy", "aten::copy_", "aten::sub", "aten::rms_norm",
                         "aten::_fused_rms_norm")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    parser.add_argument("--num-seqs", type=int, default=32, help="decode this many of W3's sequences (at most 32)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--block-size", type=int, help="the KV cache's block size (default: the engine's)")
    parser.add_argument("--top", type=int, default=15, help="ops listed")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncengine.config.engine import config_from_dict
    from asyncengine.config.model import build_model_config
    from asyncengine.loader.model_source import resolve_model_dir
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.plugin_runtime.platform_resolution import set_current_platform
    from asyncengine.plugin_runtime.records import StartupTrace
    from asyncengine.wire.engine_core import SamplingOptions
    from asyncengine.wire.worker import NewRequestData, SchedulerOutput
    from asyncengine.worker.model_runner import ModelRunner
    from throughput import WORKLOADS, draw_workload

    config = config_from_dict({"model": None, "dtype": args.dtype, "skip_tokenizer_init": True,
                               "max_model_len": 2048, **({"block_size": args.block_size} if args.block_size else {})})
    model_config = build_model_config(config, model_dir=resolve_model_dir(None), default_dtype="float32",
                                      tokenizer=None)
    StartupTrace("frontend")  # this process plays every role, as in-process engines do
    set_current_platform(CpuPlatform)
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform())
    runner.load_model()
    block_size = config.block_size
    prompts, max_tokens = draw_workload(*WORKLOADS["w3"])
    prompts, max_tokens = prompts[: args.num_seqs], max_tokens[: args.num_seqs]
    new, scheduled, next_block = [], {}, 0
    if args.prefill:
        prompts, max_tokens = [prompts[0] * (1 + args.prefill // len(prompts[0]))], [1]
        prompts[0] = prompts[0][: args.prefill]
    for index, (prompt, out) in enumerate(zip(prompts, max_tokens)):
        output = [] if args.prefill else [1 + (index * 7 + i) % 5000 for i in range(out // 2)]
        length = len(prompt) + len(output) + 1
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(blocks)
        computed = 0 if args.prefill else len(prompt) + len(output) - 1
        new.append(NewRequestData(request_id=f"r{index}", prompt_token_ids=prompt, output_token_ids=output,
                                  sampling=SamplingOptions(), block_ids=blocks, num_computed_tokens=computed))
        scheduled[f"r{index}"] = len(prompt) if args.prefill else 1
    runner.initialize_kv_cache(max(next_block, 2048 // block_size))
    runner._update_states(SchedulerOutput(new_requests=new))
    step = SchedulerOutput(num_scheduled_tokens=scheduled)
    contexts = [len(p) + (0 if args.prefill else m // 2) for p, m in zip(prompts, max_tokens)]
    for _ in range(3):  # warm-up
        runner.execute_model(step)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        runner.execute_model(step)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            runner.execute_model(step)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    by_group: dict[str, float] = {}
    for e in events:
        by_group[group_of(e.key)] = by_group.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    kind = f"prefill of {args.prefill} tokens" if args.prefill else \
        f"decode of {len(prompts)} sequences, contexts {min(contexts)}-{max(contexts)} (sum {sum(contexts)})"
    print(f"{args.dtype}, {kind}, {torch.get_num_threads()} threads: median step {median * 1000:.1f} ms "
          f"(min {min(times) * 1000:.1f}) over {args.steps} steps")
    print(f"profiler self time by group (the profiler adds its own overhead per op; {total / args.steps / 1000:.1f} "
          "ms/step in all, the rest of a step is Python between ops):")
    for group, value in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {group:16s} {value / args.steps / 1000:7.1f} ms/step  {100 * value / total:5.1f}%")
    print(f"top {args.top} ops by self time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(f"  {e.key:40s} {e.self_cpu_time_total / args.steps / 1000:7.2f} ms/step  calls/step "
              f"{e.count // args.steps:5d}  {100 * e.self_cpu_time_total / total:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
