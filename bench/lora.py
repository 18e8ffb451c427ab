"""Multi-LoRA throughput: W3 (float32) with 4 adapters spread over the requests against no adapters, same run.

    python bench/lora.py                  # W3 on the default model: base engine, then 4 adapters of rank 8
    python bench/lora.py --num-seqs 8     # a quicker, smaller draw of W3's shape
    python bench/lora.py --rank 16 --targets q_proj,v_proj

Both runs use the same draw (bench/throughput.py's `draw_workload`, WORKLOADS.md), greedy, ignore_eos. The
adapters are random matrices in PEFT's file format on every attention and MLP projection (by default),
request i using adapter i % 4, `max_loras=4`. The base run is an engine without `enable_lora`. Prints the
machine's load (`uptime`) before and after, and one summary line with the ratio (the issue's goal: the
LoRA run at least 0.7 of the base run's throughput on CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import WORKLOADS, draw_workload  # noqa: E402

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapters(model_dir: Path, directory: Path, count: int, rank: int, targets: list[str]) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    q = config["num_attention_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    paths = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in targets:
                fan_in, fan_out = shapes[target]
                prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[target]}.{target}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(fan_out, rank, generator=generator)
        path = directory / f"adapter-{index}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
        paths.append(path)
    return paths


def run(model: str, prompts, max_tokens, options: dict, loras) -> tuple[float, int]:
    from asyncengine import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", **options)
    try:
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in max_tokens]
        requests = [{"prompt_token_ids": p} for p in prompts]
        warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
        # warm-up on prompts of its own: the workload's would sit in the prefix cache and skip their prefill
        warm_up = [{"prompt_token_ids": [11 + i] * 40} for i in range(2)]
        llm.generate(warm_up, [warm] * 2, lora_request=loras[:2] if loras else None)
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the default model)")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default=",".join(PROJECTIONS))
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    from asyncengine.loader.model_source import resolve_model_dir
    from asyncengine.interfaces.lora_resolver import LoRARequest

    num_seqs, lo, hi, out_lo, out_hi = WORKLOADS["w3"]
    prompts, max_tokens = draw_workload(args.num_seqs or num_seqs, lo, hi, out_lo, out_hi)
    model_dir = Path(resolve_model_dir(args.model))
    adapters = write_adapters(model_dir, Path(tempfile.mkdtemp(prefix="asyncengine-lora-bench-")), args.num_adapters,
                              args.rank, [t.strip() for t in args.targets.split(",") if t.strip()])
    loras = [LoRARequest(f"adapter-{i % len(adapters)}", i % len(adapters) + 1, str(adapters[i % len(adapters)]))
             for i in range(len(prompts))]
    before = uptime()
    print(f"load before: {before}", flush=True)
    base_s, base_tokens = run(str(model_dir), prompts, max_tokens, {}, None)
    lora_s, lora_tokens = run(str(model_dir), prompts, max_tokens,
                              dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank), loras)
    after = uptime()
    print(f"load after: {after}", flush=True)
    expected = sum(max_tokens)
    if base_tokens != expected or lora_tokens != expected:
        print(f"error: generated {base_tokens} and {lora_tokens} tokens, expected {expected}", file=sys.stderr)
        return 1
    ratio = (lora_tokens / lora_s) / (base_tokens / base_s)
    result = {"num_seqs": len(prompts), "output_tokens": expected, "adapters": len(adapters), "rank": args.rank,
              "targets": args.targets, "base_s": round(base_s, 2), "base_tok_s": round(base_tokens / base_s, 2),
              "lora_s": round(lora_s, 2), "lora_tok_s": round(lora_tokens / lora_s, 2), "ratio": round(ratio, 3),
              "uptime_before": before, "uptime_after": after}
    print(f"w3-lora: {expected} output tokens, base {base_tokens / base_s:.1f} tok/s ({base_s:.1f} s), "
          f"{len(adapters)} adapters r={args.rank} {lora_tokens / lora_s:.1f} tok/s ({lora_s:.1f} s), "
          f"ratio {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
