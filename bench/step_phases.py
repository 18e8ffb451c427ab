"""Where a small decode step's time goes, without the profiler (bench/profile_step.py --phases).

Printed: the runner's own phases (StepTimings: input preparation, forward, logits + sampling + read-back),
the forward pass alone at each thread count, one decoder layer's ops each timed alone in a loop (the module
call, and where there is one, the bare kernel below it: the difference is Python and dispatch) times the
number of layers, and the floor: the bytes of weights a step reads at the read bandwidth measured here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def _times_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return times


def _min_ms(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` calls: on a shared machine, the call's own cost (the median adds whatever
    the other processes took from it)."""
    return min(_times_ms(fn, repeats))


def read_bandwidth(megabytes: int = 256) -> float:
    """Bytes/s of a read-only pass over a large bfloat16 tensor (a sum: reads, no writes)."""
    import torch

    data = torch.ones(megabytes * 2**20 // 2, dtype=torch.bfloat16)
    seconds = _min_ms(lambda: data.sum(dtype=torch.float32), 5) / 1000
    return data.numel() * 2 / seconds


def print_phases(runner: Any, step: Any, steps: int) -> None:
    import torch

    outputs = [runner.execute_model(step) for _ in range(steps)]
    timings = [o.timings for o in outputs if o.timings is not None]
    prepare = 1000 * min(t.prepare for t in timings)
    forward = 1000 * min(t.forward for t in timings)
    print(f"runner phases (fastest of {steps} steps, ms): prepare {prepare:.2f}, forward {forward:.2f} (this "
          "script's repeated step samples nothing: the head and the sampler are timed below)")
    inputs = runner._prepare_inputs(dict(step.num_scheduled_tokens))
    model = runner.model
    threads_before = torch.get_num_threads()
    with torch.inference_mode():
        for threads in sorted({1, threads_before}):
            torch.set_num_threads(threads)
            ms = _times_ms(lambda: model(inputs.input_ids, inputs.positions, inputs.metadata), steps)
            print(f"  forward alone (the modules), {threads} thread(s): min {min(ms):.2f} ms, "
                  f"median {statistics.median(ms):.2f} ms")
            captured = runner.cpu_decode
            if captured is not None and captured.applies(inputs.metadata):
                ms = _times_ms(lambda: captured.run(inputs.input_ids, inputs.positions, inputs.metadata), steps)
                print(f"  forward alone (the captured CPU decode step, its LM head included where it runs it), "
                      f"{threads} thread(s): min {min(ms):.2f} ms, "
                      f"median {statistics.median(ms):.2f} ms")
        torch.set_num_threads(threads_before)
        _layer_ops(runner, inputs, steps * 20)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = read_bandwidth()
    print(f"floor: {weight_bytes / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s read "
          f"({torch.get_num_threads()} threads) = {1000 * weight_bytes / bandwidth:.2f} ms a step")


def _layer_ops(runner: Any, inputs: Any, repeats: int) -> None:
    """One decoder layer's ops, each alone, at this step's rows; module call and bare kernel."""
    import torch

    model = runner.model
    layers = [layer for layer in model.model.layers if hasattr(layer, "self_attn")]
    layer = layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    rows = inputs.input_ids.shape[0]
    dtype = runner.dtype
    hidden = torch.randn(rows, attn.qkv_proj.in_features, dtype=dtype)
    residual = torch.randn_like(hidden)
    cos_sin = attn.rotary_emb.lookup(inputs.positions, dtype)
    qkv = attn.qkv_proj(hidden)
    q, k, v = qkv.split(attn.split_sizes, dim=-1)
    q = q.reshape(rows, attn.num_heads, attn.head_dim)
    k = k.reshape(rows, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(rows, attn.num_kv_heads, attn.head_dim).contiguous()
    gate_up = mlp.gate_up_proj(hidden)
    act = mlp.act(gate_up)
    attn_out = torch.randn(rows, attn.num_heads * attn.head_dim, dtype=dtype)

    def bare(linear: Any, x: torch.Tensor) -> Callable[[], Any]:
        packed = getattr(linear, "cpu_packed_weight", None)
        if packed is None:
            return lambda: torch.nn.functional.linear(x, linear.weight)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    ops: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = [
        ("add+RMSNorm", lambda: layer.input_layernorm(hidden, residual), None),
        ("qkv_proj", lambda: attn.qkv_proj(hidden), bare(attn.qkv_proj, hidden)),
        ("rotary", lambda: attn.rotary_emb(q.clone(), k.clone(), cos_sin), None),
        ("attention (store+decode)", lambda: attn.attn(q, k, v, inputs.metadata), None),
        ("o_proj", lambda: attn.o_proj(attn_out), bare(attn.o_proj, attn_out)),
        ("add+RMSNorm", lambda: layer.post_attention_layernorm(hidden, residual), None),
        ("gate_up_proj", lambda: mlp.gate_up_proj(hidden), bare(mlp.gate_up_proj, hidden)),
        ("SiLU-and-mul", lambda: mlp.act(gate_up), None),
        ("down_proj", lambda: mlp.down_proj(act), bare(mlp.down_proj, act)),
    ]
    total_module = total_bare = 0.0
    print(f"one decoder layer's ops alone ({rows} rows, {torch.get_num_threads()} threads, fastest call, us), "
          f"x{len(layers)} layers:")
    for name, module_call, bare_call in ops:
        module_us = 1000 * _min_ms(module_call, repeats)
        bare_us = 1000 * _min_ms(bare_call, repeats) if bare_call is not None else module_us
        total_module += module_us
        total_bare += bare_us
        print(f"  {name:26s} module {module_us:7.1f}  bare kernel {bare_us:7.1f}")
    print(f"  layer sum: module calls {total_module:.0f} us, bare kernels {total_bare:.0f} us; "
          f"x{len(layers)} = {total_module * len(layers) / 1000:.2f} ms (bare {total_bare * len(layers) / 1000:.2f})")
    empty = torch.empty(0)
    noop_us = 1000 * _min_ms(lambda: torch.ops.aten.alias(empty), repeats)
    print(f"  one trivial torch op call (aten.alias): {noop_us:.1f} us")
    final = torch.randn(rows, hidden.shape[1], dtype=dtype)  # every row samples in a decode step
    head_ms = _min_ms(lambda: model.compute_logits(final), repeats // 4)
    logits = model.compute_logits(final)
    argmax_us = 1000 * _min_ms(lambda: logits.argmax(-1).tolist(), repeats)
    print(f"  LM head {tuple(model.lm_head.weight.shape)}: {head_ms:.2f} ms; argmax + read-back {argmax_us:.0f} us")
