"""The built-in attention backend "TRITON_PAGED": the Triton kernels of ops/triton_attention.py, the
split-K decode kernel for decode-only steps and the variable-length causal kernel for steps with a
prompt (or a chunk of one) in them. Chosen by the CUDA platform only; the CPU platform keeps TORCH_PAGED."""

from __future__ import annotations

import torch

from asyncengine.attention.backend import AttentionBackend
from asyncengine.ops.triton_kv_store import store_kv_triton as store_kv
from asyncengine.ops.triton_attention import paged_decode_attention, paged_prefill_attention

# The step's seq_lens on the device, built by the first layer and reused by the others: every layer
# gets the same metadata object, and holding it here keeps its identity from being reused.
_step_lens: tuple[object, torch.Tensor, int] | None = None


def _seq_lens_on(metadata, device: torch.device) -> tuple[torch.Tensor, int]:
    global _step_lens
    if _step_lens is None or _step_lens[0] is not metadata or _step_lens[1].device != device:
        lens = torch.tensor(metadata.seq_lens, dtype=torch.int32, device=device)
        _step_lens = (metadata, lens, max(metadata.seq_lens))
    return _step_lens[1], _step_lens[2]


class TritonPagedBackend(AttentionBackend):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.query_lens and all(n == 1 for n in metadata.query_lens):
            # Decode only: query row b is sequence b's single new token.
            seq_lens, max_seq_len = _seq_lens_on(metadata, query.device)
            return paged_decode_attention(query, key_cache, value_cache, metadata.block_tables, seq_lens,
                                          self.scale, max_seq_len=max_seq_len)
        # A prompt (or a chunk of one) is in the step: one launch covers it and the step's decodes.
        return paged_prefill_attention(query, key_cache, value_cache, metadata.block_tables, metadata.query_lens,
                                       metadata.seq_lens, self.scale)
