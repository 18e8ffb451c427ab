"""The native architectures on every engine path, against transformers: the matrix the suite samples.

    python bench/model_matrix.py                        # every architecture, every path
    python bench/model_matrix.py --models gemma3 olmo2 --paths tp2 pp2
    python bench/model_matrix.py --model-impl transformers --paths batch chunked prefix preempt

Each architecture is a tiny random model of tests/support/native_models.py or, for the mixtures of experts,
tests/support/moe_models.py (sliding windows of 16 tokens where it has them); each path runs prompts longer than the window through the engine and compares every sequence
with transformers decoding it alone (greedy tokens identical up to a tie, top-5 logprobs within 1e-3, as
tests/models/test_native_architectures.py does): `batch` (plain), `chunked` (prefill in chunks of 16 tokens),
`prefix` (a shared 40-token prefix, run twice: prefix-cache hits), `preempt` (a KV cache too small for the
batch), `tp2` (two tensor-parallel ranks, mp workers), `pp2` (two pipeline stages), `lora` (a random PEFT
adapter on q_proj, v_proj, o_proj and down_proj, where the checkpoint has them unfused; transformers with the
adapter applied is then the reference; peft is installed into a temporary folder when missing), `pooling`
(`--runner pooling`: each prompt's embedding, the last token's final hidden state normalized, within 1e-4 of
transformers'). One line per (model, path), then a summary line; the exit status is 1 when any cell failed.
`--model-impl transformers` runs the same cells through the transformers backend (docs/models.md), which
refuses tp2, pp2, lora and pooling by design.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("ASYNCENGINE_CPU_AUTO_DTYPE", "float32")

NUM_TOKENS = 24
PATHS = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "prefix": dict(block_size=8),
    "preempt": dict(max_model_len=96, block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=40),
    "tp2": dict(tensor_parallel_size=2, kv_cache_memory_bytes=4 * 2**20),
    # the mixtures of experts only: each rank half the experts, whole (docs/distributed.md, "Expert parallelism")
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory_bytes=4 * 2**20),
    "pp2": dict(pipeline_parallel_size=2, kv_cache_memory_bytes=4 * 2**20),
    "lora": dict(enable_lora=True, max_loras=1, max_lora_rank=8),
    "pooling": dict(runner="pooling"),
}
# Models whose every layer has a sliding window (one KV cache group that keeps only the window's blocks), and the
# KV cache that makes their batch preempt: the smallest that holds one sequence (its window, a 32-token step).
EVERY_LAYER_SLIDES = {"mistral": 10, "phi3": 9, "mixtral": 10}
# The projections a LoRA adapter targets, where the checkpoint holds them apart (Phi-3 fuses q/k/v: an adapter
# on its `qkv_proj` is refused, docs/models.md).
# The mixtures of experts: attention only (an adapter on the experts is not supported, docs/models.md).
LORA_TARGETS = {"phi3": ["o_proj", "down_proj"], **{name: ["q_proj", "v_proj", "o_proj"]
                                                    for name in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")}}


class _Folders:
    """tests/support/lora_adapters.py's peft_module asks pytest's tmp_path_factory for a folder: a stand-in."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


def prompts_for(vocab_size: int, path: str) -> list[list[int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(3, vocab_size) for _ in range(40 if path == "prefix" else 0)]
    # At most 64 tokens: the tiny Phi-3's LongRoPE original context, past which a prompt is rotated per position
    # here and by its whole length in transformers (docs/models.md); its decode goes past 64 as transformers'.
    lengths = {"preempt": (60, 33, 47, 25, 58, 40), "prefix": (3, 20, 17, 9)}.get(path, (3, 40, 17, 64))
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def run_pooling(model, prompts: list[list[int]]) -> tuple[int, int, float, str]:
    import torch

    from asyncengine import LLM

    with LLM(str(model.path), skip_tokenizer_init=True, max_model_len=256, **PATHS["pooling"]) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    worst = 0.0
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            last = model.hf_model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1)
        worst = max(worst, float((torch.tensor(output.outputs.embedding) - expected).abs().max()))
    if worst >= 1e-4:
        raise AssertionError(f"embeddings differ from transformers' by {worst:.3g}")
    return len(prompts), 0, worst, "embedding error (not logprobs)"


def run_cell(model, path: str, references: dict, folders: _Folders,
             model_impl: str = "auto") -> tuple[int, int, float, str]:
    """(sequences, tokens compared, largest logprob error, note); raises on a mismatch."""
    from asyncengine import LLM, LoRARequest, SamplingParams
    from support.hf_reference import check_greedy, hf_greedy

    options = {"skip_tokenizer_init": True, "max_model_len": 256, "model_impl": model_impl, **PATHS[path]}
    if path == "preempt" and model.name in EVERY_LAYER_SLIDES:  # a sequence holds its window only: a smaller cache
        options["num_gpu_blocks_override"] = EVERY_LAYER_SLIDES[model.name]
    prompts = prompts_for(model.vocab_size, path)
    if path == "pooling":
        return run_pooling(model, prompts)
    reference_model, lora, cache = model.hf_model, None, references
    if path == "lora":
        from support.lora_adapters import make_adapter, peft_module

        targets = LORA_TARGETS.get(model.name, ["q_proj", "v_proj", "o_proj", "down_proj"])
        adapter = make_adapter(peft_module(folders), model.path, folders.mktemp("adapter"), name="matrix",
                               rank=8, targets=targets, scale=0.5)
        reference_model, lora, cache = adapter.reference, LoRARequest("matrix", 1, str(adapter.path)), {}
    llm = LLM(str(model.path), **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
        runs = 2 if path == "prefix" else 1
        tokens, worst, ties = 0, 0.0, 0
        for _ in range(runs):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
            for prompt, output in zip(prompts, outputs):
                key = tuple(prompt)
                if key not in cache:
                    cache[key] = hf_greedy(reference_model, prompt, NUM_TOKENS)
                result = check_greedy(output.outputs[0], cache[key])
                tokens, worst, ties = tokens + result.num_compared, max(worst, result.max_logprob_error), ties + result.tie
        stats = llm.get_scheduler_stats()
        if stats.kv_cache_usage != 0.0:
            raise AssertionError(f"KV blocks still in use after the batch: {stats}")
        note = f"ties {ties}"
        if path == "prefix":
            note += f", prefix hits {stats.prefix_cache_hits} of {stats.prefix_cache_queries} tokens"
            if stats.prefix_cache_hits == 0:
                raise AssertionError("no prefix-cache hit")
        if path == "preempt":
            note += f", preemptions {stats.num_preemptions}"
            if stats.num_preemptions == 0:
                raise AssertionError("the batch fit: nothing was preempted")
        return len(prompts) * runs, tokens, worst, note
    finally:
        llm.close()


def main() -> int:
    from support.moe_models import MOE_SPECS, build_moe_model
    from support.native_models import SPECS, build_native_model

    names = list(SPECS) + list(MOE_SPECS)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=names, choices=names)
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"])
    args = parser.parse_args()
    failed = cells = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="model-matrix-") as root:
        folders = _Folders(Path(root))
        for name in args.models:
            model = (build_native_model if name in SPECS else build_moe_model)(name, Path(root) / name)
            references: dict = {}
            for path in args.paths:
                if path == "ep2" and name not in MOE_SPECS:
                    continue  # no experts to split
                cells += 1
                cell_started = time.perf_counter()
                try:
                    sequences, tokens, worst, note = run_cell(model, path, references, folders, args.model_impl)
                    verdict = f"ok    {sequences} sequences, {tokens} tokens, max logprob error {worst:.1e}, {note}"
                except Exception as exc:  # a failed cell is reported and the matrix goes on
                    failed += 1
                    verdict = f"FAIL  {type(exc).__name__}: {str(exc)[:300]}"
                    traceback.print_exc(file=sys.stderr)
                print(f"{name:9} {path:8} {verdict} ({time.perf_counter() - cell_started:.1f} s)", flush=True)
    print(f"model matrix: {cells - failed}/{cells} cells agree with transformers "
          f"({len(args.models)} models x {len(args.paths)} paths, {time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
