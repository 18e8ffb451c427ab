"""The one script for a lent GPU (issue 7): correctness first, then W1 through asyncengine, then the first 64
requests of W1 through transformers' continuous batching, for the ratio. At most about 5 minutes.

    # on the GPU machine (../shared/device/fetch-wheels.sh pytest pluggy iniconfig packaging: the wheels to carry):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
      PYTHONPATH=$PWD:$PWD/tests:/tmp/site python3 bench/gpu.py --commit $(cat .commit)
    # here, on CPU, the same stages on tiny shapes (checks the script, not the speed):
    .venv/bin/python bench/gpu.py --smoke --out /tmp/gpu-smoke

After each stage the JSON so far is written to OUT/gpu.json (OUT: --out, else $OUT, else bench/out), so a run cut
short still leaves what it measured. No throughput figure is written when stage 1 failed. Every run prints the
decode-step time split from the engine core's step trace: scheduling and folding outputs in (engine core), and
inside the worker input preparation, the forward pass (host time and, on a GPU, device time from CUDA events)
and sampling with the read-back of the tokens; and how many decode steps replayed a CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

W1_OUTPUT_TOKENS = 133_966  # WORKLOADS.md: the sum of W1's drawn output lengths
HF_REQUESTS = 64


class Report:
    """The JSON of the run, written whole after every stage."""

    def __init__(self, out_dir: Path, **header) -> None:
        self.path = out_dir / "gpu.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {**header, "stages": {}}
        self.write()

    def stage(self, name: str, result: dict) -> None:
        self.data["stages"][name] = result
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def environment(args) -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = args.commit
    if commit is None:
        probe = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = probe.stdout.strip() if probe.returncode == 0 else "unknown (pass --commit)"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'cpu'})"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit, "device": device,
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "smoke": args.smoke}


# -- stage 1: correctness ----------------------------------------------------------------------------------


def traced_generate(llm, prompts: list[list[int]], params) -> tuple[list, dict]:
    """llm.generate with the engine core's step trace on: the outputs, and how many steps replayed a CUDA graph
    (so the correctness checks say whether they exercised the graphs)."""
    def core(method: str):
        return llm._portal.call(llm.engine.call_engine_core, method)

    core("start_step_trace")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    trace = core("stop_step_trace")
    return outputs, {"steps": len(trace), "cuda_graph_steps": sum(1 for record in trace if record[12])}


def greedy_parity(device: str, dtype: str, names: list[str], num_tokens: int) -> dict:
    """Greedy tokens of asyncengine vs transformers (float32, eager) on tiny random models, with the tie rule
    of tests/support/hf_reference.py: a divergence counts only where transformers' top-2 logits are within 1e-4."""
    from asyncengine import LLM, SamplingParams
    from support.hf_reference import compare_greedy, hf_greedy
    from support.tiny_models import build_tiny_model

    results = {}
    prompts = [[5, 6, 7, 8, 9], [11, 3, 200, 17, 4, 90, 31, 8], list(range(20, 60))]
    for name in names:
        tiny = build_tiny_model(name, Path(tempfile.mkdtemp(prefix=f"gpu-{name}-")))
        # max_num_seqs 8: decode graphs for 1, 2, 4 and 8 sequences only (capturing is part of what is checked)
        with LLM(str(tiny.path), skip_tokenizer_init=True, device=device, dtype=dtype, max_model_len=256,
                 kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
            outputs, steps = traced_generate(llm, prompts, params)
        compared = []
        for prompt, output in zip(prompts, outputs):
            ours = list(output.outputs[0].token_ids)
            comparison = compare_greedy(ours, None, hf_greedy(tiny.hf_model, prompt, num_tokens))
            compared.append({"tokens": comparison.num_compared, "tie": comparison.tie})
        results[name] = {"compared": compared, **steps}
    return results


def w1_shape_parity(device: str, shape: dict, num_tokens: int) -> dict:
    """Greedy tokens of asyncengine vs transformers on the W1 model shape itself (random weights, float32).
    transformers runs on CPU (a few dozen forward passes of 0.6B parameters); asyncengine on `device`.
    With the default initializer the logits are flat, so ties (top-2 within 1e-4) end comparisons early."""
    import torch
    import transformers

    from asyncengine import LLM, SamplingParams
    from support.hf_reference import compare_greedy, hf_greedy

    options = {k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype", "rope_theta")}
    options["max_position_embeddings"] = 1024
    config = transformers.Qwen3Config(**options, rope_parameters={"rope_type": "default",
                                                                  "rope_theta": shape["rope_theta"]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    directory = Path(tempfile.mkdtemp(prefix="gpu-w1-shape-"))
    model.save_pretrained(directory)
    prompts = [[(13 * i + 5) % (config.vocab_size - 3) + 3 for i in range(n)] for n in (7, 40, 130)]
    with LLM(str(directory), skip_tokenizer_init=True, device=device, dtype="float32", max_model_len=512,
             kv_cache_memory_bytes=256 * 2**20, max_num_seqs=8) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        outputs, steps = traced_generate(llm, prompts, params)
    compared = []
    for prompt, output in zip(prompts, outputs):
        comparison = compare_greedy(list(output.outputs[0].token_ids), None, hf_greedy(model, prompt, num_tokens))
        compared.append({"tokens": comparison.num_compared, "tie": comparison.tie})
    return {"layers": config.num_hidden_layers, "compared": compared, **steps}


def kernel_checks(device: str) -> dict:
    """The kernel tests (tests/ops): each Triton kernel vs the torch reference beside it, on fresh random inputs
    with outputs poisoned. On the GPU they run compiled on CUDA tensors (ASYNCENGINE_KERNEL_DEVICE=cuda);
    on CPU under the Triton interpreter, as in CI."""
    import importlib.util

    env = dict(os.environ)
    if device == "cuda":
        env["ASYNCENGINE_KERNEL_DEVICE"] = "cuda"
    if importlib.util.find_spec("pytest") is None:
        return {"ok": None, "skipped": "pytest is not installed here (add it to the carried wheels)"}
    completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = completed.stdout.strip().splitlines()[-1:] or completed.stderr.strip().splitlines()[-1:]
    result = {"ok": completed.returncode == 0, "summary": tail[0] if tail else "", "returncode": completed.returncode,
              "where": "compiled on CUDA tensors" if device == "cuda" else "Triton interpreter on CPU"}
    if completed.returncode != 0:
        result["output_tail"] = completed.stdout[-4000:]
    return result


# -- stage 2: W1 through asyncengine ------------------------------------------------------------------------


def split_of_steps(trace: list) -> dict:
    """Mean milliseconds per decode step (a step of at most one token per running sequence) spent scheduling and
    folding outputs in (engine core), and inside the worker: preparing inputs, the forward pass (host time, and
    device time from CUDA events where there are some), sampling with the read-back; the worker's whole step
    as the engine core sees it; and the share of decode steps that replayed a CUDA graph.
    StepRecord fields: step, tokens, schedule start/end, execute start/end, update start/end, prepare, forward,
    sample, device_forward, cuda_graph."""
    steps = [record for record in trace if record[1] <= 512]  # decode-sized steps; prefill steps are larger
    if not steps:
        return {}
    count = len(steps)

    def mean_ms(values) -> float:
        values = list(values)
        return round(1000 * sum(values) / len(values), 3) if values else -1.0

    device_times = [r[11] for r in steps if r[11] >= 0]
    return {"decode_steps": count,
            "schedule_ms": mean_ms(r[3] - r[2] for r in steps),
            "execute_ms": mean_ms(r[5] - r[4] for r in steps),
            "prepare_ms": mean_ms(r[8] for r in steps),
            "forward_host_ms": mean_ms(r[9] for r in steps),
            "forward_device_ms": mean_ms(device_times),
            "sample_ms": mean_ms(r[10] for r in steps),
            "update_ms": mean_ms(r[7] - r[6] for r in steps),
            "cuda_graph_fraction": round(sum(1 for r in steps if r[12]) / count, 3)}


def print_split(split: dict) -> None:
    print(f"decode-step split over {split.get('decode_steps', 0)} steps (ms): schedule {split.get('schedule_ms')}, "
          f"worker {split.get('execute_ms')} = prepare {split.get('prepare_ms')} + forward {split.get('forward_host_ms')}"
          f" (device {split.get('forward_device_ms')}) + sample {split.get('sample_ms')}; update "
          f"{split.get('update_ms')}; CUDA graph replays {100 * split.get('cuda_graph_fraction', 0):.0f}%", flush=True)


def run_w1(args, device: str, dtype: str, shape: dict, workload: tuple) -> dict:
    import anyio

    from runtime import traced_run
    from throughput import draw_workload, random_model_dir

    prompts, max_tokens = draw_workload(*workload)
    config = dict(model=random_model_dir(shape, None), skip_tokenizer_init=True, load_format="dummy",
                  device=device, dtype=dtype)

    async def main() -> dict:
        generated, elapsed, trace = await traced_run(config, prompts, max_tokens)
        return {"output_tokens": generated, "expected_output_tokens": sum(max_tokens), "seconds": round(elapsed, 3),
                "asyncengine_tok_s": round(generated / elapsed, 1), "step_split": split_of_steps(trace)}

    return anyio.run(main, backend="trio")


# -- stage 3: transformers' continuous batching -------------------------------------------------------------


def run_hf_continuous(device: str, dtype: str, shape: dict, workload: tuple, count: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from throughput import draw_workload, random_model_dir

    prompts, max_tokens = draw_workload(*workload)
    prompts, max_tokens = prompts[:count], max_tokens[:count]
    config = AutoConfig.from_pretrained(random_model_dir(shape, None))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                             attn_implementation="sdpa").to(device).eval()
    # One generation config for the batch: every request runs to the longest length, eos ignored; only the
    # tokens each request asked for would count in W1, so the figure uses what was generated, all of it.
    generation = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0))  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=generation)
    elapsed = time.perf_counter() - start
    generated = sum(len(result.generated_tokens) for result in results.values())
    return {"requests": count, "output_tokens": generated, "seconds": round(elapsed, 3),
            "hf_tok_s": round(generated / elapsed, 1), "attn_implementation": model.config._attn_implementation}


# -- the run --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for gpu.json (default: $OUT, else bench/out)")
    parser.add_argument("--commit", help="the commit being measured (the device machine has no .git)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, not speed")
    args = parser.parse_args()

    from throughput import QWEN3_06B_SHAPE, SMALL_SHAPE, WORKLOADS

    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "out")
    if args.smoke:
        device, dtype, shape = "cpu", "float32", dict(SMALL_SHAPE, num_hidden_layers=2)
        workload, hf_count, parity_tokens = (8, 16, 64, 8, 32), 4, 8
        parity_shape = dict(QWEN3_06B_SHAPE, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                            bos_token_id=1, eos_token_id=2)
    else:
        device, dtype, shape = "cuda", "bfloat16", QWEN3_06B_SHAPE
        workload, hf_count, parity_tokens = WORKLOADS["w1"], HF_REQUESTS, 32
        parity_shape = QWEN3_06B_SHAPE
    report = Report(out_dir, **environment(args), workload="W1" if not args.smoke else "W1-smoke (8 sequences)")
    print(f"gpu.py: {report.data['device']}, torch {report.data['torch']}, triton {report.data['triton']}, "
          f"commit {report.data['commit']}; writing {report.path}", flush=True)

    # Stage 1: correctness. The greedy checks run in float32 (transformers' reference is float32).
    started = time.perf_counter()
    try:
        parity = greedy_parity(device, "float32", ["llama", "qwen3"], parity_tokens)
        parity["w1_shape"] = w1_shape_parity(device, parity_shape, 16)
        kernels = kernel_checks(device)
        passed = kernels["ok"] is not False
        report.stage("correctness", {"ok": passed, "greedy": parity, "kernels": kernels,
                                     "seconds": round(time.perf_counter() - started, 1)})
    except Exception as error:  # noqa: BLE001 - a failed stage is recorded with its traceback, and ends the run
        report.stage("correctness", {"ok": False, "error": f"{type(error).__name__}: {error}",
                                     "traceback": traceback.format_exc()})
        passed = False
    print(f"stage 1 (correctness): {'passed' if passed else 'FAILED'}", flush=True)
    if not passed:
        print("no throughput figure is written when stage 1 fails", flush=True)
        return 1

    # Stage 2: W1 through asyncengine.
    w1 = run_w1(args, device, dtype, shape, workload)
    report.data["asyncengine_tok_s"] = w1["asyncengine_tok_s"]
    report.stage("asyncengine_w1", w1)
    split = w1["step_split"]
    print(f"stage 2 (asyncengine W1): {w1['asyncengine_tok_s']} output tok/s, {w1['output_tokens']} tokens "
          f"(expected {w1['expected_output_tokens']}) in {w1['seconds']} s", flush=True)
    print_split(split)
    if not args.smoke and w1["output_tokens"] != W1_OUTPUT_TOKENS:
        print(f"WARNING: W1 should produce {W1_OUTPUT_TOKENS} output tokens", flush=True)

    # Stage 3: transformers' continuous batching on the first requests of the same workload.
    try:
        hf = run_hf_continuous(device, dtype, shape, workload, hf_count)
        report.data["hf_tok_s"] = hf["hf_tok_s"]
        report.data["ratio"] = round(w1["asyncengine_tok_s"] / hf["hf_tok_s"], 2)
        report.stage("hf_continuous_batching", hf)
        print(f"stage 3 (transformers continuous batching, first {hf_count} requests): {hf['hf_tok_s']} tok/s; "
              f"ratio {report.data['ratio']}", flush=True)
    except Exception as error:  # noqa: BLE001 - recorded; the asyncengine figure above stands on its own
        report.stage("hf_continuous_batching", {"error": f"{type(error).__name__}: {error}",
                                                "traceback": traceback.format_exc()})
        print(f"stage 3 failed: {type(error).__name__}: {error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
