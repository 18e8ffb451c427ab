"""Host time of the engine core's per-step work at W1's batch size, without a model (issue 7's decode-step split).

    .venv/bin/python bench/scheduler_step.py       # W1's 256 requests, greedy, ignore_eos, as bench/gpu.py sends them

Feeds W1's draw (prompts of 100-1024 tokens) to the Scheduler with a KV cache large enough for all of it, answers each
step with one token per sampling request (what the worker would send), and times `schedule()` and
`update_from_output()` separately for the steps that are decode-only. With async scheduling the engine core does this
while the worker runs the previous step, so on a GPU it is hidden as long as it stays under the worker's step time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main() -> int:
    from asyncengine.engine_core.block_manager import BlockManager
    from asyncengine.engine_core.scheduler import Scheduler
    from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
    from asyncengine.wire.worker import ModelRunnerOutput
    from throughput import WORKLOADS, draw_workload

    prompts, max_tokens = draw_workload(*WORKLOADS["w1"])
    block_size = 16
    blocks = sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_tokens)) + 64
    scheduler = Scheduler(block_manager=BlockManager(blocks, block_size), max_num_seqs=256,
                          max_num_batched_tokens=2048, max_model_len=4096)
    for index, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        scheduler.add_request(EngineCoreRequest(
            request_id=f"r{index}", prompt_token_ids=list(prompt),
            sampling=SamplingOptions(temperature=0.0, max_tokens=n)))  # no eos ids: ignore_eos
    schedule_times, update_times, batch_sizes = [], [], []
    tokens = 0
    while scheduler.has_unfinished_requests():
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        # The requests whose scheduled tokens reach their end sample one token (the worker's answer).
        sampling = [rid for rid, n in output.num_scheduled_tokens.items()
                    if scheduler.sequences[rid].num_computed_tokens + n >= scheduler.sequences[rid].num_tokens]
        runner_output = ModelRunnerOutput(request_ids=sampling, sampled_token_ids=[7] * len(sampling))
        updating = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        updated = time.perf_counter()
        tokens += len(sampling)
        if output.num_scheduled_tokens and all(n == 1 for n in output.num_scheduled_tokens.values()):
            schedule_times.append(scheduled - started)
            update_times.append(updated - updating)
            batch_sizes.append(len(output.num_scheduled_tokens))
    print(f"W1 through the scheduler alone: {tokens} output tokens, {len(schedule_times)} decode-only steps "
          f"(mean batch {statistics.mean(batch_sizes):.0f}, largest {max(batch_sizes)})")
    big = [i for i, n in enumerate(batch_sizes) if n >= 200]
    for label, chosen in (("all decode steps", range(len(batch_sizes))), ("steps of >= 200 sequences", big)):
        print(f"{label}: schedule median {1000 * statistics.median(schedule_times[i] for i in chosen):.3f} ms, "
              f"update median {1000 * statistics.median(update_times[i] for i in chosen):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
