"""The transformers backend against native, on the default model (SmolLM2-135M-Instruct), same run.

    python bench/transformers_backend.py                    # batch 1 and 8, 64 new tokens, 2 rounds
    python bench/transformers_backend.py --batches 1 8 32 --new-tokens 128 --dtype float32

For each round and each implementation (model_impl native, then transformers: one engine alive at a time), the
same prompts (random token ids, 32 each, seeded) decode greedily with ignore_eos: once with 1 new token (the
prefill) and once with `--new-tokens`, for each batch size; decode tok/s is the extra tokens over the extra time,
`batch * (new_tokens - 1) / (t_new_tokens - t_1)`, so the prefill is not counted. Each figure is the best of the
rounds (the machine is shared: the best round is the least disturbed one). Also prints how many sequences gave
the same tokens on both paths (the two compute in different orders, so in bfloat16 a near-tie may go either way).
Prints the machine's load (`uptime`) before and after, one line per (implementation, batch), and a summary line
with the slowdown (native tok/s over transformers tok/s) per batch size.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def measure(impl: str, batches: list[int], new_tokens: int, prompt_len: int, dtype: str) -> dict:
    from asyncengine import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(max(batches))]
    results = {}
    with LLM(model_impl=impl, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=64 * 2**20,
             enable_prefix_caching=False) as llm:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm)
        for batch in batches:
            inputs = [{"prompt_token_ids": p} for p in prompts[:batch]]
            timings, tokens = [], None
            for count in (1, new_tokens):
                params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
                started = time.perf_counter()
                outputs = llm.generate(inputs, params)
                timings.append(time.perf_counter() - started)
                tokens = [o.outputs[0].token_ids for o in outputs]
            rate = batch * (new_tokens - 1) / (timings[1] - timings[0])
            results[batch] = (rate, tokens)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print(f"load before: {load()}")
    best: dict[tuple[str, int], float] = {}
    last_tokens: dict[tuple[str, int], list] = {}
    for round_index in range(args.rounds):
        for impl in ("native", "transformers"):
            for batch, (rate, tokens) in measure(impl, args.batches, args.new_tokens, args.prompt_len,
                                                 args.dtype).items():
                print(f"round {round_index + 1} {impl:12s} batch {batch:3d}: {rate:7.1f} decode tok/s", flush=True)
                best[impl, batch] = max(rate, best.get((impl, batch), 0.0))
                last_tokens[impl, batch] = tokens
    print(f"load after: {load()}")
    parts = []
    for batch in args.batches:
        native, transformers = best["native", batch], best["transformers", batch]
        same = sum(a == b for a, b in zip(last_tokens["native", batch], last_tokens["transformers", batch]))
        parts.append(f"batch {batch}: native {native:.1f} / transformers {transformers:.1f} tok/s = "
                     f"{native / transformers:.2f}x slower ({same}/{batch} sequences token-identical)")
    print(f"transformers backend vs native, SmolLM2-135M, dtype {args.dtype}, {args.new_tokens} new tokens, best of "
          f"{args.rounds}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
