"""The built-in attention backend "TRITON_PAGED": the Triton kernels of ops/triton_attention.py, the
split-K decode kernel for decode-only steps and the variable-length causal kernel for steps with a
prompt (or a chunk of one) in them. Chosen by the CUDA platform only; the CPU platform keeps TORCH_PAGED."""

from __future__ import annotations

import torch

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.ops.triton_kv_store import store_kv_triton as store_kv
from asyncengine.ops.triton_attention import paged_decode_attention, paged_prefill_attention


class TritonPagedBackend(AttentionBackend):
    # No sliding window and no soft cap in the kernels yet: layers needing them get TORCH_PAGED (selector.py).
    supports_sliding_window = False
    supports_logits_soft_cap = False

    # Decode reads only device tensors and sizes its grid from block_tables' width when max_seq_len is
    # None; padding rows (slot -1, context 0) store nothing and come out as zeros.
    cuda_graph_safe = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.decode_only:
            # Query row b is sequence b's single new token.
            return paged_decode_attention(query, key_cache, value_cache, metadata.block_tables,
                                          metadata.seq_lens_tensor, self.scale, max_seq_len=metadata.max_seq_len)
        # A prompt (or a chunk of one) is in the step: one launch covers it and the step's decodes.
        return paged_prefill_attention(query, key_cache, value_cache, metadata.block_tables,
                                       metadata.query_start_loc, metadata.seq_lens_tensor, self.scale,
                                       max_query_len=metadata.max_query_len)
