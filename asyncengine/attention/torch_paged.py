"""The built-in attention backend "TORCH_PAGED": the paged attention of ops/paged_attention.py in plain
torch (the CPU path, and the reference other backends are checked against).

On CPU tensors of float32 or bfloat16, decoding sequences are attended by the in-place kernel of
ops/cpu_attention.py (it reads each sequence's cache pages where they lie, where the torch reference
gathers them into a copy every layer and step), once it has been compiled; elsewhere, or without a C
compiler, by the torch reference. Prefills use torch's scaled_dot_product_attention either way.
"""

from __future__ import annotations

import torch

from asyncengine.attention.backend import AttentionBackend
from asyncengine.ops import cpu_attention
from asyncengine.ops.paged_attention import AttentionPlan, paged_attention, store_kv


def decode_in_place(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: AttentionPlan,
                    scale: float, output: torch.Tensor) -> None:
    seqs, rows, lens = plan.decode_index
    # Named for torch.profiler (a ctypes call is no torch op); next to nothing when no profiler runs.
    with torch.profiler.record_function("asyncengine::cpu_paged_decode"):
        cpu_attention.paged_decode(query.contiguous(), key_cache, value_cache, plan.block_tables, lens, seqs, rows,
                                   scale, output)


class TorchPagedBackend(AttentionBackend):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        decode = None
        if key_cache.device.type == "cpu" and cpu_attention.available(key_cache.dtype) \
                and key_cache.is_contiguous() and value_cache.is_contiguous():
            decode = decode_in_place
        # This step's keys and values are passed too: a prompt computed whole this step reads them
        # directly instead of gathering them back from the cache.
        return paged_attention(query, key_cache, value_cache, metadata.plan, self.scale, new_key=key,
                               new_value=value, decode=decode)
