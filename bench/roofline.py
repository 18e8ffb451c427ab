"""This machine's ceiling for W3 and each engine's fraction of it.

    .venv/bin/python bench/roofline.py                                   # measure, print W3's floor per dtype
    .venv/bin/python bench/roofline.py --result asyncengine-fp32=a.json --result llama.cpp-fp32=b.json

Measures, with torch and the threads it uses: the GEMM peak per dtype (the best of several large square
matmuls, through torch.mm and through the engine's oneDNN path, whichever is faster: MKL's torch.mm takes
a slow path on AMD CPUs) and copy bandwidth (a large tensor copied, read plus written bytes). Then W3's
work (../shared/WORKLOADS.md) on the default model's shape: the linear layers on every prompt and
generated token, attention at each token's context (QK^T and PV), the LM head on the sampled positions
(one per generated token). The floor of a run: in float32, that work at the float32 GEMM peak (math
bound, unless the reads below take longer); in bfloat16, the reads of the decode steps at copy bandwidth
(the weights once per step, every running sequence's cached keys and values once per step and layer)
plus the work at the bfloat16 peak.
A `--result NAME=FILE` (bench/throughput.py --json output, or any JSON with `output_tokens` and a
`*_tok_s` figure) is printed as a fraction of the floor of its dtype (`--dtype-of NAME=bfloat16`, else
guessed from the name, else float32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def gemm_peak(dtype, size: int = 2048, repeats: int = 8, clock=time.perf_counter) -> dict[str, float]:
    """FLOP/s of the best of `repeats` square matmuls, two ways: torch.mm (BLAS: MKL on x86, which on AMD
    CPUs takes a slow path) and the engine's own linear path (oneDNN on a weight reordered once,
    asyncengine/models/layers/cpu_gemm.py). The machine's peak is the better of the two. `clock`: wall time,
    or `time.thread_time` for a single-threaded measurement's CPU time (bench/moe.py --clock cpu)."""
    import torch

    from asyncengine.models.layers import cpu_gemm

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    packed = cpu_gemm.pack(b)
    ways = {"torch.mm": lambda: torch.mm(a, b)}
    if packed is not None:
        ways["oneDNN"] = lambda: cpu_gemm.linear(a, b, packed)
    peaks = {}
    for name, run in ways.items():
        run()
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            run()
            best = min(best, clock() - start)
        peaks[name] = 2 * size**3 / best
    return peaks


def copy_bandwidth(megabytes: int = 256, repeats: int = 8, clock=time.perf_counter) -> float:
    """Bytes/s moved by a large copy (read and written bytes both counted); `clock` as in `gemm_peak`."""
    import torch

    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        target.copy_(source)
        best = min(best, clock() - start)
    return 2 * source.numel() * 4 / best


def w3_work(config: dict, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, float]:
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    linear_params = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                              + 3 * hidden * inter)
    prompt_tokens, generated = sum(len(p) for p in prompts), sum(max_tokens)
    # Sum over every computed token of its context length (itself included).
    contexts = sum(n * (n + 1) // 2 for n in (len(p) for p in prompts))
    contexts += sum(sum(len(p) + i + 1 for i in range(m)) for p, m in zip(prompts, max_tokens))
    flops = {
        "linear": 2.0 * linear_params * (prompt_tokens + generated),
        "attention": 4.0 * layers * heads * head_dim * contexts,
        "head": 2.0 * hidden * vocab * generated,
    }
    # A decode step reads every running sequence's cached keys and values once, in every layer.
    decode_contexts = sum(sum(len(p) + i for i in range(1, m)) for p, m in zip(prompts, max_tokens))
    return {"flops": sum(flops.values()), **{f"{k}_flops": v for k, v in flops.items()},
            "kv_elements": 2.0 * layers * kv_heads * head_dim * decode_contexts,
            "linear_params": linear_params, "embedding_params": hidden * vocab,
            "decode_steps": max(max_tokens), "generated": generated, "prompt_tokens": prompt_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", action="append", default=[], help="NAME=FILE (throughput.py --json)")
    parser.add_argument("--dtype-of", action="append", default=[], help="NAME=float32|bfloat16")
    args = parser.parse_args()

    import torch

    from asyncengine.loader.model_source import resolve_model_dir
    from throughput import WORKLOADS, draw_workload

    config = json.loads((Path(resolve_model_dir(None)) / "config.json").read_text())
    prompts, max_tokens = draw_workload(*WORKLOADS["w3"])
    work = w3_work(config, prompts, max_tokens)
    threads = torch.get_num_threads()
    ways = {name: gemm_peak(getattr(torch, name)) for name in ("float32", "bfloat16")}
    peaks = {name: max(by_way.values()) for name, by_way in ways.items()}
    bandwidth = copy_bandwidth()
    measured = "; ".join(f"{name} " + ", ".join(f"{way} {value / 1e9:.0f}" for way, value in by_way.items())
                         for name, by_way in ways.items())
    print(f"{threads} threads: GEMM peak float32 {peaks['float32'] / 1e9:.0f} GFLOP/s, bfloat16 "
          f"{peaks['bfloat16'] / 1e9:.0f} GFLOP/s ({measured}); copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"W3 work: {work['flops'] / 1e12:.2f} TFLOP (linear {work['linear_flops'] / 1e12:.2f}, attention "
          f"{work['attention_flops'] / 1e12:.2f}, head {work['head_flops'] / 1e12:.2f}); {work['generated']} "
          f"output tokens, {work['prompt_tokens']} prompt tokens, {work['decode_steps']} decode steps")
    floors = {}
    for name, element in (("float32", 4), ("bfloat16", 2)):
        math = work["flops"] / peaks[name]
        weights = (work["linear_params"] + work["embedding_params"]) * element
        weight_traffic = work["decode_steps"] * weights / bandwidth
        kv_traffic = work["kv_elements"] * element / bandwidth
        traffic = weight_traffic + kv_traffic
        # float32 is bound by its arithmetic, which the reads can overlap; bfloat16's arithmetic is so much
        # faster that the decode steps' reads add to it.
        floors[name] = max(math, traffic) if name == "float32" else traffic + math
        print(f"floor {name}: {floors[name]:.2f} s ({work['generated'] / floors[name]:.0f} output tok/s; math "
              f"{math:.2f} s, weight traffic {weight_traffic:.2f} s = {work['decode_steps']} steps x "
              f"{weights / 1e6:.0f} MB, KV-cache reads of the decode steps {kv_traffic:.2f} s = "
              f"{work['kv_elements'] * element / 1e9:.0f} GB)")
    dtypes = dict(item.split("=", 1) for item in args.dtype_of)
    for item in args.result:
        name, path = item.split("=", 1)
        data = json.loads(Path(path).read_text())
        tok_s = next(v for k, v in data.items() if k.endswith("tok_s"))
        dtype = dtypes.get(name) or ("bfloat16" if "bf16" in name or "bfloat16" in name else "float32")
        ceiling = work["generated"] / floors[dtype]
        print(f"{name}: {tok_s:.1f} tok/s = {100 * tok_s / ceiling:.1f}% of the {dtype} ceiling ({ceiling:.0f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
