"""The built-in attention backend "TORCH_PAGED": the paged attention of ops/paged_attention.py in plain
torch (the CPU path, and the reference other backends are checked against).

On CPU tensors of float32 or bfloat16, once the C library of ops/cpu_attention.py is compiled, this
step's keys and values are stored by it (two row copies per token and KV head instead of torch's
index_copy_ pair), and every query row is attended by its in-place kernel, which reads each sequence's
cache pages where they lie (the torch reference gathers them into a copy every layer and step). A
prefill's rows are causal queries like decodes (row i sees its context up to its own position), so a
chunk of a prompt needs neither a gather of its cached prefix nor a mask; on W3's prompt lengths
(64-512 tokens) this ran prefill attention about 1.8x faster than torch's scaled_dot_product_attention,
and no slower up to 4,096 tokens (bench/RESULTS.md). Elsewhere, or without a C compiler, the torch
reference: prefills through scaled_dot_product_attention, decodes grouped.
"""

from __future__ import annotations

import torch

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.ops import cpu_attention
from asyncengine.ops.paged_attention import AttentionPlan, paged_attention, store_kv


def attend_in_place(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: AttentionPlan,
                    scale: float, output: torch.Tensor, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    seqs, rows, lens = plan.query_index
    # Named for torch.profiler (a ctypes call is no torch op); next to nothing when no profiler runs.
    with torch.profiler.record_function("asyncengine::cpu_paged_attention"):
        cpu_attention.paged_decode(query.contiguous(), key_cache, value_cache, plan.block_tables, lens, seqs, rows,
                                   scale, output, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                   sinks=sinks)


class TorchPagedBackend(AttentionBackend):
    # Both in the C kernel (a window start per row, the cap before the softmax, each head's sink logit as one more
    # term of its softmax) and in the torch reference.
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        in_place = None
        if key_cache.device.type == "cpu" and cpu_attention.available(key_cache.dtype) \
                and key_cache.is_contiguous() and value_cache.is_contiguous():
            in_place = attend_in_place
        if in_place is not None and key.dtype == key_cache.dtype and key.stride(2) == 1 and value.stride(2) == 1:
            cpu_attention.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        else:
            store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        # This step's keys and values are passed too: on the torch reference, a prompt computed whole this
        # step reads them directly instead of gathering them back from the cache.
        return paged_attention(query, key_cache, value_cache, metadata.plan, self.scale, new_key=key,
                               new_value=value, in_place=in_place, sliding_window=self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)
