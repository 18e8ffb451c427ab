"""Run by test_triton_elementwise.py in a subprocess: on CPU tensors with TRITON_INTERPRET=1 (set before
any kernel module is imported: `triton.jit` chooses the interpreter when it decorates, reading the
environment then), or, with ASYNCENGINE_KERNEL_DEVICE=cuda, compiled on CUDA tensors (every tensor
is made on `DEVICE`; fp32 is checked without TF32). Each check compares a kernel with its torch
reference on fresh random inputs; outputs are poisoned with NaN before each run, so a value the
kernel never wrote shows. Prints one JSON line per check: {"name", "ok", "detail", "device"}.
"""

from __future__ import annotations

import json
import os
import sys

DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernels are checked under the Triton interpreter), "
             "or with ASYNCENGINE_KERNEL_DEVICE=cuda on a GPU machine")

import torch  # noqa: E402

from asyncengine.ops import triton_activation, triton_kv_store, triton_norm, triton_rotary  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # no matmul here, but fp32 stays ieee if one comes
torch.backends.cudnn.allow_tf32 = False

# fp32 must match to rounding noise; fp16/bf16 to one or two units in the last place of their dtype.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
generator = torch.Generator().manual_seed(int(os.environ.get("CHECK_SEED", "0")))


def rand(*shape, dtype):
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def compare(name, got, want):
    if got.shape != want.shape or got.dtype != want.dtype:
        return dict(name=name, ok=False, detail=f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    if torch.isnan(got).any():
        return dict(name=name, ok=False, detail=f"{int(torch.isnan(got).sum())} NaN values (unwritten output)")
    atol, rtol = TOLERANCE[want.dtype]
    ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
    return dict(name=name, ok=ok, detail=f"max abs diff {(got.float() - want.float()).abs().max().item():.3g}")


def with_poisoned_outputs(fn, *args):
    """Run fn with torch.empty / empty_like returning NaN-filled tensors, so unwritten outputs are NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *shape, dtype=None, device=None, **kw: torch.full(
        shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape, float("nan"), dtype=dtype, device=device)
    torch.empty_like = lambda t, **kw: torch.full_like(t, float("nan"))
    try:
        return fn(*args)
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def checks():
    for dtype in DTYPES:
        tag = str(dtype).removeprefix("torch.")
        for shape in [(3, 64), (2, 3, 80)]:  # 80: not a power of two, the masked tail runs
            x, weight = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
            got = with_poisoned_outputs(triton_norm.rms_norm_triton, x, weight, 1e-6)
            yield compare(f"rms_norm {tag} {shape}", got, triton_norm.rms_norm_reference(x, weight, 1e-6))
            residual = rand(*shape, dtype=dtype)
            out, summed = with_poisoned_outputs(triton_norm.fused_add_rms_norm_triton, x, residual, weight, 1e-6)
            want_out, want_sum = triton_norm.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
            yield compare(f"fused_add_rms_norm out {tag} {shape}", out, want_out)
            yield compare(f"fused_add_rms_norm residual {tag} {shape}", summed, want_sum)
        for shape in [(4, 2 * 48), (2, 3, 2 * 1030)]:  # 1030 > BLOCK: two programs per row
            x = rand(*shape, dtype=dtype)
            got = with_poisoned_outputs(triton_activation.silu_and_mul_triton, x)
            yield compare(f"silu_and_mul {tag} {shape}", got, triton_activation.silu_and_mul_reference(x))
        for tokens, heads, kv_heads, head_dim in [(5, 4, 2, 16), (3, 2, 1, 24)]:
            query, key = rand(tokens, heads, head_dim, dtype=dtype), rand(tokens, kv_heads, head_dim, dtype=dtype)
            # cos/sin as RotaryEmbedding.lookup makes them (angles twice), and arbitrary ones (halves differ)
            angles = (torch.rand(tokens, 1, head_dim // 2, generator=generator) * 20).to(DEVICE)
            tables = {"lookup": (torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)),
                      "arbitrary": (rand(tokens, 1, head_dim, dtype=dtype), rand(tokens, 1, head_dim, dtype=dtype))}
            for kind, (cos, sin) in tables.items():
                q, k = with_poisoned_outputs(triton_rotary.rotary_triton, query, key, cos, sin)
                want_q, want_k = triton_rotary.rotary_reference(query, key, cos, sin)
                yield compare(f"rotary query {kind} {tag} d={head_dim}", q, want_q)
                yield compare(f"rotary key {kind} {tag} d={head_dim}", k, want_k)
        for kv_heads, num_blocks, block_size, head_dim, tokens in [(2, 6, 4, 16, 7), (1, 3, 8, 24, 5)]:
            shape = (kv_heads, num_blocks, block_size, head_dim)
            key_cache, value_cache = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
            key, value = rand(tokens, kv_heads, head_dim, dtype=dtype), rand(tokens, kv_heads, head_dim, dtype=dtype)
            slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens].to(DEVICE)
            want_k, want_v = key_cache.clone(), value_cache.clone()
            triton_kv_store.store_kv_reference(key, value, want_k, want_v, slots)
            triton_kv_store.store_kv_triton(key, value, key_cache, value_cache, slots)
            yield dict(name=f"store_kv {tag} {shape}", ok=torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v),
                       detail="caches bit-equal to the reference's, untouched slots kept")
            padded = torch.cat((slots[:2], torch.tensor([-1], device=DEVICE)))  # a padding token (slot -1) writes nothing
            before_k = key_cache.clone()
            triton_kv_store.store_kv_triton(rand(3, kv_heads, head_dim, dtype=dtype), rand(3, kv_heads, head_dim, dtype=dtype),
                                            key_cache, value_cache, padded)
            changed = (key_cache != before_k).any(-1).any(0).flatten().nonzero().flatten().sort().values
            yield dict(name=f"store_kv_padding slot -1 is skipped {tag} {shape}", ok=changed.tolist() == sorted(slots[:2].tolist()),
                       detail=f"slots changed: {changed.tolist()}")


for result in checks():
    result["device"] = DEVICE
    print(json.dumps(result), flush=True)
