"""The one-call CPU decode step alone (ops/cpu_decode_step.py), ABAB against another tree's kernel in one run.

    .venv/bin/python bench/decode_kernel.py --baseline-tree /tmp/main              # 1 sequence, bfloat16
    .venv/bin/python bench/decode_kernel.py --baseline-tree /tmp/main --rows 4 --dtype float32 --threads 1

The default model's shapes (30 layers, hidden 576, 9 heads over 3 KV heads of 64, intermediate 1536, vocab
49152, tied head) with random weights, each sequence at a context of 600 tokens (W5's middle). Each tree's
ops/cpu_decode_step.py is loaded as its own module (its C source builds its own library); a tree whose kernel
does not run the LM head gets it from the engine's own path (cpu_gemm.linear over the packed weight), so both
time a step up to its logits. Rounds alternate A B A B; it prints each round's ms per step and the ratio of
the medians and of the minima (baseline / this tree: above 1 is faster). The step without the engine around
it: Python, scheduling and sampling are bench/latency.py's.

`--gguf`: also this tree's step with its four products over GGUF blocks (`quantization="gguf"`: Q4_1-like
4-bit integers with a scale and an offset per block of 32, at 4 bits, or 8 with `--gguf-int8`, as
ops/cpu_block_int8.py packs them), in the same rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS, VOCAB = 576, 9, 3, 64, 1536, 30, 49152
CONTEXT, BLOCK_SIZE = 600, 16


def load_kernel(tree: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / "ops" / "cpu_decode_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, help="also time this tree's kernel, alternately")
    parser.add_argument("--rows", type=int, default=1, help="sequences in the step (1-8)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--gguf", action="store_true", help="also time the step over GGUF blocks")
    parser.add_argument("--gguf-int8", action="store_true", help="with --gguf: the blocks at 8 bits, not 4")
    args = parser.parse_args()

    import torch

    from asyncengine.models.layers import cpu_gemm

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline_tree)] if args.baseline_tree else [])
    kernels = [load_kernel(tree, f"decode_kernel_{i}") for i, (_, tree) in enumerate(trees)]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.05).to(dtype)

    rows, blocks_per_row = args.rows, -(-CONTEXT // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row
    layers = [(1 + rand(HIDDEN), rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), rand(HIDDEN, HEADS * HEAD_DIM),
               1 + rand(HIDDEN), rand(2 * INTERMEDIATE, HIDDEN), rand(HIDDEN, INTERMEDIATE),
               rand(KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM), rand(KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM))
              for _ in range(LAYERS)]
    embed, final_norm = rand(VOCAB, HIDDEN), 1 + rand(HIDDEN)
    packed = cpu_gemm.pack(embed)
    ids = torch.arange(rows, dtype=torch.int64)
    cos, sin = rand(rows, HEAD_DIM), rand(rows, HEAD_DIM)
    tables = torch.arange(num_blocks, dtype=torch.int64).view(rows, blocks_per_row)
    slots = torch.tensor([r * blocks_per_row * BLOCK_SIZE + CONTEXT - 1 for r in range(rows)], dtype=torch.int64)
    seq_lens = torch.full((rows,), CONTEXT, dtype=torch.int32)

    steps = []
    for kernel in kernels:
        with_head = "lm_head" in inspect.signature(kernel.DecoderWeights.__init__).parameters
        weights = kernel.DecoderWeights(layers, embed, final_norm, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                        head_dim=HEAD_DIM, eps=1e-5, scale=HEAD_DIM**-0.5,
                                        **({"lm_head": embed} if with_head else {}))

        def step(kernel=kernel, weights=weights, with_head=with_head):
            result = kernel.decode_step(weights, ids, cos, sin, slots, tables, seq_lens)
            return result[1] if with_head else cpu_gemm.linear(result, embed, packed)
        steps.append(step)
    if args.gguf:
        from asyncengine.ops import cpu_block_int8

        def blocks(rows_out: int, width: int) -> cpu_block_int8.PackedBlocks:
            q = torch.randint(-8, 8, (rows_out, width), generator=generator, dtype=torch.int8)
            scale = torch.rand(rows_out, width // 32, generator=generator) * 0.01
            offset = (torch.rand(rows_out, width // 32, generator=generator) - 0.5) * 0.02
            packed = cpu_block_int8.pack(q, scale, offset)
            return packed if args.gguf_int8 else cpu_block_int8.pack_nibbles(packed)

        shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN),
                  (HIDDEN, INTERMEDIATE)]
        block_weights = [[blocks(*shape) for shape in shapes] for _ in layers]
        float_free = [(layer[0], None, None, layer[3], None, None) + layer[6:] for layer in layers]
        gguf_weights = kernels[0].DecoderWeights(float_free, embed, final_norm, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                                 head_dim=HEAD_DIM, eps=1e-5, scale=HEAD_DIM**-0.5, lm_head=embed,
                                                 blocks=block_weights)
        trees.append(("gguf", ROOT))
        steps.append(lambda: kernels[0].decode_step(gguf_weights, ids, cos, sin, slots, tables, seq_lens)[1])
    logits = [step().float() for step in steps]  # builds each library, and checks they agree
    if len(trees) >= 2 and trees[1][0] == "baseline":
        print(f"logits: largest difference between the trees {(logits[0] - logits[1]).abs().max().item():.4g}")
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(args.rounds):
        for step, into in zip(steps, times):
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            into.append(1000 * (time.perf_counter() - started) / args.steps)
    print(f"decode step, {rows} sequence(s) at context {CONTEXT}, {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"load {open('/proc/loadavg').read().split()[0]}")
    for (name, tree), into in zip(trees, times):
        print(f"{name:10s} {str(tree):28s} ms/step " + " ".join(f"{t:.2f}" for t in into)
              + f"  median {statistics.median(into):.2f}  min {min(into):.2f}")
    for (name, _), into in list(zip(trees, times))[1:]:
        print(f"ratio {name}/this tree: median {statistics.median(into) / statistics.median(times[0]):.3f}, "
              f"min {min(into) / min(times[0]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
