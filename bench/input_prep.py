"""Host time of the model runner's input preparation for one step, without a model (issue 7's decode-step split).

    .venv/bin/python bench/input_prep.py                # 256 decoding sequences with W1-like contexts
    .venv/bin/python bench/input_prep.py --prefill 2048 # plus one 2048-token prompt chunk in the step

Builds a ModelRunner with no model loaded, fills it with requests as the scheduler would send them (W1's draw: prompts
of 100-1024 tokens, half of their output generated), and times `_prepare_inputs` over many steps on CPU tensors. On
a GPU the copies are queued without waiting, so the host cost is this plus a few microseconds per copy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=0, help="tokens of one prompt chunk added to the step")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    import torch

    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.wire.engine_core import SamplingOptions
    from asyncengine.wire.worker import NewRequestData, SchedulerOutput
    from asyncengine.worker.model_runner import ModelRunner

    block_size, max_model_len = 16, 4096
    engine = EngineConfig(block_size=block_size, max_num_seqs=args.num_seqs)
    model = ModelConfig(model_dir="", tokenizer_dir=None, served_model_name="none", architectures=[], hf_config={},
                        dtype="float32", max_model_len=max_model_len, vocab_size=151936, eos_token_ids=[],
                        generation_defaults={})  # no model is built: input preparation reads the lengths only
    runner = ModelRunner(engine, model, torch.device("cpu"), CpuPlatform())
    rng = random.Random(0)
    new, scheduled, next_block = [], {}, 0
    for index in range(args.num_seqs + (1 if args.prefill else 0)):
        prefill = index == args.num_seqs
        prompt = [rng.randrange(151936) for _ in range(args.prefill if prefill else rng.randint(100, 1024))]
        output = [] if prefill else [rng.randrange(151936) for _ in range(rng.randint(50, 500))]
        length = len(prompt) + len(output) + 1
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(blocks)
        request_id = f"r{index}"
        new.append(NewRequestData(request_id=request_id, prompt_token_ids=prompt, output_token_ids=output,
                                  sampling=SamplingOptions(), block_ids=blocks,
                                  num_computed_tokens=0 if prefill else len(prompt) + len(output) - 1))
        scheduled[request_id] = args.prefill if prefill else 1
    runner._update_states(SchedulerOutput(new_requests=new))
    step = SchedulerOutput(num_scheduled_tokens=scheduled)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        runner._prepare_inputs(step)
        times.append(time.perf_counter() - started)
    times.sort()
    print(f"input preparation, {args.num_seqs} decoding sequences"
          f"{f' + a {args.prefill}-token prompt chunk' if args.prefill else ''}: median "
          f"{1000 * statistics.median(times):.3f} ms, p10 {1000 * times[len(times) // 10]:.3f} ms, "
          f"p90 {1000 * times[9 * len(times) // 10]:.3f} ms over {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
