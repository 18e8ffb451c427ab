"""The Triton paged decode-attention kernel alone on a lent GPU, at W1's shape, against its bytes.

The first H100 run of bench/gpu.py (bench/RESULTS.md, 2026-12-06) put W1's decode step at 21.5 ms of device
time, about three times its bytes at copy bandwidth. This script times the decode kernel by itself at W1's
attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, block size 16) for a batch of decoding
sequences, and prints the rate at which it streams the cache (K and V bytes of every context, read once) as a
fraction of the device's copy bandwidth measured in the same run, for the default launch and for other
tiles and split sizes, as the CUDA graph calls it (`max_seq_len` None: splits cover the whole table) and with
`max_seq_len` given. Also one whole decode step's linear layers (W1: 28 layers) as matmuls, for the split.

    python3 bench/gpu_attention.py --out $OUT        # on the GPU machine (PYTHONPATH=$PWD)
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_attention.py --smoke   # the script's logic, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after two warm-ups (CUDA events on a GPU)."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def copy_rate(device, megabytes: int, repeats: int) -> float:
    """Bytes/s of a large device copy, read and written bytes both counted."""
    import torch

    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for attention.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    from asyncengine.ops import triton_attention as ta

    device = torch.device("cpu" if args.smoke else "cuda")
    num_heads, num_kv_heads, head_dim, block_size = (4, 2, 32, 16) if args.smoke else (16, 8, 128, 16)
    max_model_len = 256 if args.smoke else 4096
    batches = [(4, 40, 200)] if args.smoke else [(256, 100, 2000), (256, 700, 700), (64, 2000, 2000), (1, 1000, 1000)]
    repeats = 2 if args.smoke else args.repeats
    dtype = torch.bfloat16
    bandwidth = copy_rate(device, 16 if args.smoke else 1024, repeats)
    report: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
                    "torch": torch.__version__, "copy_bytes_per_s": bandwidth, "cases": []}
    print(f"{report['device']}: copy {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    rng = random.Random(0)
    width = max_model_len // block_size
    for num_seqs, lo, hi in batches:
        lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
        blocks_needed = sum(-(-n // block_size) for n in lens)
        key_cache = torch.randn(num_kv_heads, blocks_needed + 1, block_size, head_dim, device=device, dtype=dtype)
        value_cache = torch.randn_like(key_cache)
        tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
        order = list(range(1, blocks_needed + 1))
        rng.shuffle(order)  # a running server's blocks are scattered
        cursor = 0
        for row, n in enumerate(lens):
            count = -(-n // block_size)
            tables[row, :count] = torch.tensor(order[cursor:cursor + count], dtype=torch.int32)
            cursor += count
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        query = torch.randn(num_seqs, num_heads, head_dim, device=device, dtype=dtype)
        out = torch.empty_like(query)
        cache_bytes = 2 * sum(lens) * num_kv_heads * head_dim * key_cache.element_size()
        variants = [("graph-shaped default", {}), ("max_seq_len given", {"max_seq_len": max(lens)})]
        for tile in (16, 32, 64, 128):
            variants.append((f"tile {tile}, max_seq_len given", {"max_seq_len": max(lens), "tile_tokens": tile}))
        for split in (4, 16, 64):
            variants.append((f"{split} blocks a split, max_seq_len given",
                             {"max_seq_len": max(lens), "blocks_per_split": split}))
        for name, options in variants:
            def call(options=options):
                ta.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim ** -0.5,
                                          out=out, **options)
            seconds = timed(call, device, repeats)
            row = {"num_seqs": num_seqs, "mean_context": sum(lens) / num_seqs, "variant": name,
                   "ms": seconds * 1e3, "cache_bytes": cache_bytes,
                   "fraction_of_copy": cache_bytes / seconds / (bandwidth / 2)}
            report["cases"].append(row)
            print(f"seqs {num_seqs:4d} ctx {row['mean_context']:7.1f}  {name:34s} {row['ms']:8.3f} ms  "
                  f"{cache_bytes / 1e6:8.1f} MB  {100 * row['fraction_of_copy']:5.1f}% of copy read rate", flush=True)
        # the rest of a W1 decode step: the linear layers of 28 layers and the head, as plain matmuls
        if not args.smoke and num_seqs == 256:
            hidden, inter, vocab, layers = 1024, 3072, 151936, 28
            def rows(width):
                return torch.randn(num_seqs, width, device=device, dtype=dtype)

            def weight(rows_in, cols):
                return torch.randn(rows_in, cols, device=device, dtype=dtype)

            x_hidden, x_attn, x_inter = rows(hidden), rows(num_heads * head_dim), rows(inter)
            pairs = [(x_hidden, weight(hidden, (num_heads + 2 * num_kv_heads) * head_dim)),
                     (x_attn, weight(num_heads * head_dim, hidden)),
                     (x_hidden, weight(hidden, 2 * inter)), (x_inter, weight(inter, hidden))]
            head = weight(hidden, vocab)

            def linears():
                for _ in range(layers):
                    for x, w in pairs:
                        torch.matmul(x, w)
                torch.matmul(x_hidden, head)
            report["linears_ms_256"] = timed(linears, device, 5) * 1e3
            print(f"28 layers' linear layers + the head at 256 rows: "
                  f"{report['linears_ms_256']:.3f} ms", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attention.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
