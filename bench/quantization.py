"""Quantized weights: accuracy against float32 and the cost of a W3 decode step (the default model, or --model).

    .venv/bin/python bench/quantization.py                      # float32, int8, int8_dynamic
    .venv/bin/python bench/quantization.py --methods none,int8,int8_dynamic --dtype bfloat16
    .venv/bin/python bench/quantization.py --model gemma-3-270m-Q4_K_M --methods gguf --transformers

Accuracy (teacher forcing over one fixed text, every position): top-1 agreement with the float32 model
(the same argmax token), each model's perplexity on the text, and the mean absolute difference of the
text tokens' log-probabilities. With --transformers, transformers' own model of the same directory in float32
is measured first, and every row (our float32 one included) is compared with it instead. Speed: the CPU time (`time.thread_time`, so a loaded machine inflates it
less than wall time) of the same W3 decode step as bench/profile_step.py (32 sequences halfway through
their outputs), median of 8, run with one thread so that the thread's CPU time is the step's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# A fixed text (the opening of the Wikipedia article "Transformer (deep learning architecture)", CC BY-SA).
TEXT = (
    "A transformer is a deep learning architecture that was developed by researchers at Google and is based on "
    "the multi-head attention mechanism, which was proposed in the 2017 paper \"Attention Is All You Need\". "
    "Text is converted to numerical representations called tokens, and each token is converted into a vector "
    "via lookup from a word embedding table. At each layer, each token is then contextualized within the scope "
    "of the context window with other (unmasked) tokens via a parallel multi-head attention mechanism, allowing "
    "the signal for key tokens to be amplified and less important tokens to be diminished. Transformers have "
    "the advantage of having no recurrent units, therefore requiring less training time than earlier recurrent "
    "neural architectures (RNNs) such as long short-term memory (LSTM). Later variations have been widely "
    "adopted for training large language models (LLMs) on large (language) datasets. The modern version of the "
    "transformer was proposed in the 2017 paper by researchers at Google. Transformers were first developed as "
    "an improvement over previous architectures for machine translation, but have found many applications "
    "since. They are used in large-scale natural language processing, computer vision (vision transformers), "
    "reinforcement learning, audio, multimodal learning, robotics, and even playing chess."
)


def build_runner(model: str | None, dtype: str, quantization: str | None):
    import torch

    from asyncengine.config.engine import config_from_dict
    from asyncengine.config.model import build_model_config
    from asyncengine.loader.model_source import resolve_model_dir
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.plugin_runtime.platform_resolution import set_current_platform
    from asyncengine.plugin_runtime.records import StartupTrace
    from asyncengine.worker.model_runner import ModelRunner

    config = config_from_dict({"model": model, "dtype": dtype, "skip_tokenizer_init": True, "max_model_len": 2048,
                               "quantization": quantization})
    model_config = build_model_config(config, model_dir=resolve_model_dir(model), default_dtype="float32",
                                      tokenizer=None)
    StartupTrace("frontend")
    set_current_platform(CpuPlatform)
    runner = ModelRunner(config, model_config, torch.device("cpu"), CpuPlatform())
    runner.load_model()
    return runner, config.block_size


def text_logprobs(runner, block_size: int, token_ids: list[int]):
    """Log-probabilities `[positions, vocab]` of the model over `token_ids` (one prefill, teacher forcing)."""
    import torch

    from asyncengine.models.layers.attention import AttentionMetadata

    n = len(token_ids)
    blocks = -(-n // block_size)

    def group_metadata(group: int) -> AttentionMetadata:
        # Each KV cache group (sliding-window layers: wire/kv_cache.py) writes blocks of its own.
        first = group * blocks
        return AttentionMetadata(torch.arange(n) + first * block_size, None, [n], [n],
                                 torch.arange(first, first + blocks).unsqueeze(0), block_size=block_size)

    metadata = group_metadata(0)
    if len(runner.kv_layout.groups) > 1:
        metadata.group_metadata = [group_metadata(g) for g in range(len(runner.kv_layout.groups))]
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), metadata)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def transformers_logprobs(model_dir: str, token_ids: list[int]):
    """transformers' float32 log-probabilities over `token_ids` (the same teacher forcing as `text_logprobs`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def decode_step_cpu_time(runner, block_size: int, steps: int = 8) -> float:
    from asyncengine.wire.engine_core import SamplingOptions
    from asyncengine.wire.worker import NewRequestData, SchedulerOutput
    from throughput import WORKLOADS, draw_workload

    prompts, max_tokens = draw_workload(*WORKLOADS["w3"])
    new, scheduled, next_block = [], {}, 0
    for index, (prompt, out) in enumerate(zip(prompts, max_tokens)):
        output = [1 + (index * 7 + i) % 5000 for i in range(out // 2)]
        blocks = list(range(next_block, next_block + -(-(len(prompt) + len(output) + 1) // block_size)))
        next_block += len(blocks)
        new.append(NewRequestData(request_id=f"r{index}", prompt_token_ids=prompt, output_token_ids=output,
                                  sampling=SamplingOptions(), block_ids=blocks,
                                  num_computed_tokens=len(prompt) + len(output) - 1))
        scheduled[f"r{index}"] = 1
    runner._update_states(SchedulerOutput(new_requests=new))
    step = SchedulerOutput(num_scheduled_tokens=scheduled)
    for _ in range(2):
        runner.execute_model(step)
    times = []
    for _ in range(steps):
        start = time.thread_time()
        runner.execute_model(step)
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", help="the quantized models' activation dtype")
    parser.add_argument("--methods", default="int8,int8_dynamic", help="comma-separated quantization methods")
    parser.add_argument("--model", help="a model directory, .gguf file or packaged model name (default: the default "
                        "model)")
    parser.add_argument("--transformers", action="store_true",
                        help="compare every row with transformers' float32 model of the same directory")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from asyncengine.loader.model_source import resolve_model_dir
    from asyncengine.wire.kv_cache import build_layout

    torch.set_num_threads(1)
    model_dir = str(resolve_model_dir(args.model))
    token_ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    targets = torch.tensor(token_ids[1:])
    load = open("/proc/loadavg").read().split()[:3]
    print(f"{model_dir}: {len(token_ids)} tokens of fixed text; 1 thread; load average {' '.join(load)} at start")
    rows = []
    reference = transformers_logprobs(model_dir, token_ids)[:-1] if args.transformers else None
    against = "transformers float32" if args.transformers else "float32"
    # The float32 model first (the reference), then each method in --dtype ("none": no quantization).
    for index, name in enumerate(["none", *[m for m in args.methods.split(",") if m]]):
        method = None if name == "none" else name
        dtype = "float32" if index == 0 else args.dtype
        runner, block_size = build_runner(args.model, dtype, method)
        layout = build_layout({index: window for index, window in runner.kv_cache_spec()})
        runner.initialize_kv_cache(1024, layout)  # enough for the text, then for the W3 step's contexts
        logprobs = text_logprobs(runner, block_size, token_ids)[:-1]
        # The W3 step is built with one KV cache group: not measured for a sliding-window model (several groups).
        step = decode_step_cpu_time(runner, block_size) if len(layout.groups) == 1 else None
        if reference is None:
            reference = logprobs
        text_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
        ref_lp = reference.gather(1, targets[:, None]).squeeze(1)
        rows.append((f"{method or 'none'} ({dtype})", float(torch.exp(-text_lp.mean())),
                     float((logprobs.argmax(-1) == reference.argmax(-1)).float().mean()),
                     float((text_lp - ref_lp).abs().mean()), step))
        del runner
    print(f"| method | perplexity | top-1 agreement with {against} | mean abs logprob diff | W3 decode step, CPU s |")
    print("|---|---|---|---|---|")
    for name, ppl, agree, diff, step in rows:
        print(f"| {name} | {ppl:.3f} | {100 * agree:.1f}% | {diff:.4g} | {'-' if step is None else f'{step:.3f}'} |")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
