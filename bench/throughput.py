"""Offline throughput: output tokens per second of a whole batch, prefill included, after a warm-up.

    python bench/throughput.py                      # W3: 32 requests on the default model (CPU), float32
    python bench/throughput.py --dtype auto         # W3-auto: the same in the CPU's default dtype
    python bench/throughput.py --compare hf         # ... and transformers' padded generate, same run
    python bench/throughput.py --compare llama.cpp  # ... and llama.cpp's server on the same GGUF weights, same run
    python bench/throughput.py --model gemma-3-270m-Q4_K_M --quantization gguf --compare llama.cpp
                                                    # W3 on Gemma 3 270M, llama.cpp on its Q4_K_M file as it is
    python bench/throughput.py --acceptance         # issue 17's figures: W3 float32, W3-auto, int8_dynamic, gguf, each
                                                    # against llama.cpp at its precision, in one run
    python bench/throughput.py --workload w1 --random-model qwen3-0.6b --num-seqs 8 --max-input 256 --max-output 64

Workloads are defined in ../shared/WORKLOADS.md: prompts of random token ids and per-request output
lengths drawn with Python's `random` from seed 0. Greedy decoding, `ignore_eos`, so every request
produces exactly its `max_tokens`; the script checks that the generated count equals their sum.
Prints one summary line (and, with --json FILE, writes the figures there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

WORKLOADS = {
    # name: (num_seqs, min_input, max_input, min_output, max_output)
    "w1": (256, 100, 1024, 100, 1024),
    "w3": (32, 64, 512, 32, 256),
}

# The shape of Qwen3-0.6B (WORKLOADS.md, W1), for random-weight runs.
QWEN3_06B_SHAPE = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
    tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
    hidden_act="silu", bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)


# A small random model whose steps take milliseconds on CPU: engine overheads (scheduling, IPC,
# output handling) become visible next to the model's time.
SMALL_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, vocab_size=10240,
    tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
    hidden_act="silu", bos_token_id=1, eos_token_id=2,
)
RANDOM_SHAPES = {"qwen3-0.6b": QWEN3_06B_SHAPE, "small": SMALL_SHAPE}


def draw_workload(num_seqs: int, lo: int, hi: int, out_lo: int, out_hi: int) -> tuple[list[list[int]], list[int]]:
    """The draws of WORKLOADS.md, in its order: every prompt first, then every output length."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(lo, hi))] for _ in range(num_seqs)]
    max_tokens = [randint(out_lo, out_hi) for _ in range(num_seqs)]
    return prompts, max_tokens


def random_model_dir(shape: dict, num_layers: int | None) -> str:
    directory = Path(tempfile.mkdtemp(prefix="asyncengine-bench-"))
    config = dict(shape)
    if num_layers:
        config["num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def load_average() -> str:
    """The 1-minute load average (figures from a loaded machine must say so: bench/RESULTS.md)."""
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "unknown"


def run_asyncengine(args, model: str | None, prompts, max_tokens, load_format: str) -> tuple[float, int]:
    from asyncengine import LLM, SamplingParams

    options = dict(load_format=load_format, skip_tokenizer_init=True, dtype=args.dtype, device=args.device,
                   quantization=args.quantization, cpu_threads=args.cpu_threads)
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(model, **options)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in max_tokens]
    requests = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up on prompts of the workload's lengths but not its tokens: the workload's own prompts would sit in the
    # prefix cache and the measured run would skip their prefill.
    warm_up = [{"prompt_token_ids": [(t + 1) % 10000 for t in p]} for p in prompts[:2]]
    llm.generate(warm_up, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)] * 2)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return elapsed, generated


def run_transformers(args, model_dir: str, prompts, max_tokens, batch_size: int) -> tuple[float, int]:
    """transformers' padded `generate`, batches sorted by prompt length, greedy, in the engine's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncengine.platforms.cpu import cpu_auto_dtype

    # The same precision as the engine's: "auto" as the CPU platform resolves it.
    dtype = getattr(torch, args.dtype if args.dtype != "auto" else cpu_auto_dtype())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def generate(indices: list[int]) -> int:
        batch = [prompts[i] for i in indices]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(max_tokens[i] for i in indices)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=pad_id,
            )
        return sum(min(max_tokens[i], out.shape[1] - width) for i in indices)

    generate(order[:2])  # warm-up
    start = time.perf_counter()
    generated = sum(generate(order[i : i + batch_size]) for i in range(0, len(order), batch_size))
    return time.perf_counter() - start, generated


def engine_precision(args) -> str:
    """The engine's precision as llama.cpp's GGUF types see it: the quantization method, else the dtype."""
    return args.quantization or activation_dtype(args)


def activation_dtype(args) -> str:
    """The dtype the engine computes in (and keeps its KV cache in): --dtype, "auto" as the CPU resolves it."""
    if args.dtype == "auto":
        from asyncengine.platforms.cpu import cpu_auto_dtype

        return cpu_auto_dtype()
    return args.dtype


# llama.cpp's KV-cache type holding what the engine's KV cache holds. llama.cpp's own default is f16 whatever the
# weights are, so its "F32" run keeps half the engine's float32 cache bytes: both figures are printed.
MATCHED_KV_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def compare_llama_cpp(args, prompts, max_tokens, threads: int, engine_tok_s: float) -> dict:
    """llama.cpp's figures for the same workload, with its default KV cache (f16) and with one at the engine's
    precision, or why it could not run (said plainly, not an error)."""
    from llama_server import GGUF_TYPES, Unavailable, run_w3

    model_file = model_gguf_file(args.model)
    # Another model than the default one runs as its file is (Gemma 3 270M's Q4_K_M), whatever the engine's precision.
    gguf_type = f"{model_file.name} as it is" if model_file else args.gguf_type or GGUF_TYPES.get(engine_precision(args))
    if gguf_type is None:
        return {"llama_cpp": f"no GGUF type matches {engine_precision(args)}", "line": " | llama.cpp: no GGUF type "
                f"matches {engine_precision(args)} (pass --gguf-type)"}
    figures: dict = {"llama_cpp_gguf": gguf_type}
    line = ""
    matched = MATCHED_KV_TYPES.get(activation_dtype(args))
    for key, kv_type in (("llama_cpp", None), ("llama_cpp_matched_kv", matched)):
        if key == "llama_cpp_matched_kv" and matched in (None, "f16"):
            break  # the default run already is the matched one
        label = f"{gguf_type}, KV {kv_type or 'f16 (its default)'}"
        try:
            seconds, generated = run_w3(prompts, max_tokens, gguf_type, threads, kv_type, model_file)
        except Unavailable as exc:
            figures.setdefault("llama_cpp", f"unavailable: {exc}")
            return {**figures, "line": line + f" | llama.cpp could not run: {exc}"}
        if generated != sum(max_tokens):
            return {**figures, "line": line + f" | llama.cpp ({label}) generated {generated} tokens, expected "
                    f"{sum(max_tokens)}: not compared"}
        tok_s = generated / seconds
        figures.update({f"{key}_kv": kv_type or "f16", f"{key}_s": round(seconds, 3), f"{key}_tok_s": round(tok_s, 2),
                        f"{key}_ratio": round(engine_tok_s / tok_s, 3)})
        line += f" | llama.cpp llama-server {label} {tok_s:.1f} tok/s ({seconds:.1f} s), ratio {engine_tok_s / tok_s:.2f}x"
    return {**figures, "line": line}


def model_gguf_file(model: str | None) -> Path | None:
    """The GGUF file behind --model, for llama.cpp (None: the default model's, at the engine's precision): a packaged
    model's (assembled in the engine's cache) or a .gguf path."""
    if model is None:
        return None
    from asyncengine.loader.gguf import default_cache_root
    from asyncengine.loader.packaged_models import gguf_path, packaged_model

    packaged = packaged_model(model)
    if packaged is not None:
        return gguf_path(packaged, default_cache_root())
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model)
    raise SystemExit(f"--compare llama.cpp needs a GGUF model: {model!r} is neither a packaged model nor a .gguf file")


# issue 17's acceptance: (label, arguments of one throughput.py run), each against llama.cpp at its precision.
ACCEPTANCE_RUNS = [
    ("W3 float32", ["--dtype", "float32"]),
    ("W3-auto", ["--dtype", "auto"]),
    ("W3 int8_dynamic", ["--dtype", "float32", "--quantization", "int8_dynamic"]),
    ("W3 gguf (Q4_1 blocks, float32)", ["--dtype", "float32", "--quantization", "gguf"]),
    ("W3 gguf (Q4_1 blocks, auto)", ["--dtype", "auto", "--quantization", "gguf"]),
]


def acceptance(args) -> int:
    import subprocess

    rows = []
    for label, extra in ACCEPTANCE_RUNS:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, *extra, "--compare", "llama.cpp", "--json", out.name]
            if args.cpu_threads:
                command += ["--cpu-threads", str(args.cpu_threads)]
            print("running:", " ".join(command[1:]), flush=True)
            done = subprocess.run(command)
            text = Path(out.name).read_text() if done.returncode == 0 else ""
        rows.append((label, json.loads(text) if text else {"error": f"exit status {done.returncode}"}))
    print("\n| run | asyncengine tok/s | llama.cpp | its default KV (f16): tok/s | ratio | KV at the engine's precision: "
          "tok/s | ratio | load |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        matched = (f"{r.get('llama_cpp_matched_kv_kv')} {r.get('llama_cpp_matched_kv_tok_s')}"
                   if "llama_cpp_matched_kv_tok_s" in r else "(the same)")
        print(f"| {label} | {r.get('asyncengine_tok_s', r.get('error'))} | {r.get('llama_cpp_gguf', r.get('llama_cpp', '-'))} "
              f"| {r.get('llama_cpp_tok_s', '-')} | {r.get('llama_cpp_ratio', '-')} | {matched} "
              f"| {r.get('llama_cpp_matched_kv_ratio', '-')} | {r.get('load_average', '-')} |")
    return 0 if all("error" not in r for _, r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w3")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--min-input", type=int)
    parser.add_argument("--max-input", type=int)
    parser.add_argument("--min-output", type=int)
    parser.add_argument("--max-output", type=int)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    parser.add_argument("--random-model", choices=sorted(RANDOM_SHAPES), help="random weights of this shape instead")
    parser.add_argument("--num-layers", type=int, help="with --random-model: fewer layers, for a quick run")
    # W3 is a float32 workload; "W3-auto" is `--dtype auto` (bfloat16 on a CPU with AMX or AVX-512 BF16).
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="the engine's KV cache (default: 2 GiB on CPU)")
    parser.add_argument("--compare", choices=["hf", "llama.cpp"],
                        help="also run transformers in the same process, or llama.cpp's server (bench/llama_server.py)")
    parser.add_argument("--gguf-type", help="with --compare llama.cpp: F32, BF16, Q8_0 or Q4_1 (default: the "
                        "engine's precision: F32 for float32, BF16 for bfloat16, Q8_0 for int8 methods)")
    parser.add_argument("--acceptance", action="store_true",
                        help="run W3 float32, W3-auto and W3 int8_dynamic, each with --compare llama.cpp, and print "
                        "the table of issue 17 (each run in its own process)")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--quantization", help="a quantization method (int8, int8_dynamic, ...)")
    parser.add_argument("--cpu-threads", type=int, help="the engine's cpu_threads (default: the CPUs available)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    if args.acceptance:
        return acceptance(args)
    preset = WORKLOADS[args.workload]
    shape = [
        getattr(args, name) if getattr(args, name) is not None else default
        for name, default in zip(("num_seqs", "min_input", "max_input", "min_output", "max_output"), preset)
    ]
    prompts, max_tokens = draw_workload(*shape)
    expected = sum(max_tokens)
    load_format = "auto"
    model = args.model
    if args.random_model:
        model = random_model_dir(RANDOM_SHAPES[args.random_model], args.num_layers)
        load_format = "dummy"

    import torch

    threads = args.cpu_threads or torch.get_num_threads()
    load_before = load_average()
    elapsed, generated = run_asyncengine(args, model, prompts, max_tokens, load_format)
    if generated != expected:
        print(f"error: generated {generated} tokens, expected {expected} (the sum of max_tokens)", file=sys.stderr)
        return 1
    result = {
        "workload": args.workload, "shape": shape, "output_tokens": generated, "threads": threads,
        "asyncengine_s": round(elapsed, 3), "asyncengine_tok_s": round(generated / elapsed, 2),
    }
    line = f"{args.workload}: {generated} output tokens, asyncengine {generated / elapsed:.1f} tok/s ({elapsed:.1f} s)"
    if args.compare == "hf":
        if args.random_model:
            print("error: --compare hf needs real weights (transformers cannot load dummy weights)", file=sys.stderr)
            return 2
        from asyncengine.loader.model_source import resolve_model_dir

        model_dir = str(resolve_model_dir(model))
        hf_elapsed, hf_generated = run_transformers(args, model_dir, prompts, max_tokens, args.hf_batch_size)
        ratio = (generated / elapsed) / (hf_generated / hf_elapsed)
        result.update(hf_s=round(hf_elapsed, 3), hf_tok_s=round(hf_generated / hf_elapsed, 2), ratio=round(ratio, 3))
        line += (
            f" | transformers generate (batches of {args.hf_batch_size}) {hf_generated / hf_elapsed:.1f} tok/s "
            f"({hf_elapsed:.1f} s) | ratio {ratio:.2f}x"
        )
    if args.compare == "llama.cpp":
        if args.random_model:
            print("error: --compare llama.cpp runs a GGUF file; drop --random-model", file=sys.stderr)
            return 2
        result.update(compare_llama_cpp(args, prompts, max_tokens, threads, generated / elapsed))
        line += result.pop("line")
    line += f" | {threads} threads | load average {load_before} before, {load_average()} after"
    result["load_average"] = [load_before, load_average()]
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
