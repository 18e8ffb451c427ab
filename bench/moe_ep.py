"""Expert parallelism against tensor parallelism on 2 ranks, the whole model: W3-shaped requests on a Qwen3-MoE
model with random weights.

    .venv/bin/python bench/moe_ep.py                 # W3's first 8 requests, bfloat16 where the CPU has it
    .venv/bin/python bench/moe_ep.py --requests 32   # all of W3 (4,387 output tokens)

No MoE model ships on PyPI, so the model is built from transformers' Qwen3MoeConfig at bench/moe.py's
"qwen3-30b-a3b/4" ratios (hidden 512, 64 experts of intermediate 192, top-8, renormalised; 8 query and 4 KV heads
of 64) with 4 layers and a 32,000-token vocabulary, random weights (`initializer_range` 0.2), saved once to a
temporary folder. The same engine options run twice per round, alternating: `tensor_parallel_size=2` (each rank
a slice of every expert, the MoE layers' outputs all-reduced) and the same with `enable_expert_parallel` (each rank
32 whole experts, the tokens sent to them and back; docs/distributed.md). W3's draws (WORKLOADS.md), the first
`--requests` of them, `ignore_eos`; metric: output tokens over the batch's wall time, after one warm-up batch. One
line per run, then the medians and their ratio, and whether both decoded the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def w3_requests(count: int) -> tuple[list[list[int]], list[int]]:
    seed(0)
    n, lo, hi, out_lo, out_hi = 32, 64, 512, 32, 256
    prompts = [[randint(0, 10000) for _ in range(randint(lo, hi))] for _ in range(n)]
    max_tokens = [randint(out_lo, out_hi) for _ in range(n)]
    return prompts[:count], max_tokens[:count]


def build_model(folder: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
                            num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
                            initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def run(model: Path, expert_parallel: bool, prompts, max_tokens, dtype: str) -> tuple[float, int, list]:
    from asyncengine import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=1024, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel, kv_cache_memory_bytes=256 * 2**20, plugins="") as llm:
        llm.generate(inputs[:2], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2)  # warm-up
        started = time.perf_counter()
        outputs = llm.generate(inputs, params)
        seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / seconds, generated, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="W3's first N requests (1-32)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    prompts, max_tokens = w3_requests(args.requests)
    print(f"# {os.uname().nodename}: load average {os.getloadavg()[0]:.1f}; {len(prompts)} W3 requests, "
          f"{sum(max_tokens)} output tokens, {args.dtype}", flush=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list] = {}
    with tempfile.TemporaryDirectory(prefix="moe-ep-") as folder:
        model = build_model(Path(folder))
        for round_index in range(args.rounds):
            for expert_parallel in (False, True):
                rate, generated, tokens[expert_parallel] = run(model, expert_parallel, prompts, max_tokens,
                                                               args.dtype)
                rates[expert_parallel].append(rate)
                print(f"round {round_index}: {'EP' if expert_parallel else 'TP'} {rate:.1f} output tok/s "
                      f"({generated} tokens)", flush=True)
    tp, ep = statistics.median(rates[False]), statistics.median(rates[True])
    # In bfloat16 the two differ by rounding (TP sums the ranks' partial products of each expert, EP computes each
    # expert whole), so greedy sequences may part after a while; in float32 they agree (tests/models).
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(tokens[False], tokens[True])]
    print(f"moe_ep: TP=2 {tp:.1f} tok/s, TP=2 + expert parallelism {ep:.1f} tok/s, EP/TP {ep / tp:.2f}x; "
          f"{same}/{len(prompts)} sequences identical, tokens agreeing before the first difference: "
          f"median {statistics.median(prefix):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
