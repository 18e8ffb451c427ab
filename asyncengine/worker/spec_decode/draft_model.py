"""The draft-model proposer (vLLM's `method: draft_model`): a smaller model of the target's family drafts k
greedy tokens per request, run by the same worker on a KV cache of its own.

The draft is any model the registry builds, loaded by the project's loader (a directory, or a .gguf file
converted as the target's would be: `resolve_draft_model_config`), in the target's dtype, its attention
layers on a `ProposerKVCache` (proposer_cache.py: the project's paged attention, with blocks this proposer
hands out per request, apart from the target's). Each step, per request, the draft's cache keeps the longest
prefix of what it computed that is still the request's history (what the target rejected is recomputed
over), computes the rest of the history in one prefill-shaped forward for the whole batch, and then decodes
k - 1 more tokens, one batched forward each. Drafts are greedy (the argmax over the ids both models score),
so they carry no probabilities: the rejection sampler takes each as certain, which keeps the target's
distribution exactly (rejection_sampler.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig, build_model_config
from asyncengine.config.speculative import FIELD, SpeculativeConfig
from asyncengine.errors import ConfigError
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.spec_decode import DraftTokens, ProposalBatch, ProposerContext
from asyncengine.loader.model_loader import load_model
from asyncengine.loader.model_source import resolve_model_dir
from asyncengine.worker.spec_decode.proposer_cache import CachedModelProposer, Chunk



def resolve_draft_model_config(model: str, *, dtype: str) -> ModelConfig:
    """The draft's ModelConfig from speculative_config.model (a directory or a .gguf file), in `dtype`."""
    model_dir = resolve_model_dir(model, progress=False)
    engine_config = EngineConfig(model=model, dtype=dtype, skip_tokenizer_init=True)
    return build_model_config(engine_config, model_dir=model_dir, default_dtype=dtype, tokenizer=None,
                              architectures=ModelRegistry)


def common_prefix(cached: list[int], history: np.ndarray) -> int:
    """How many leading entries of `cached` equal `history`'s."""
    n = min(len(cached), len(history))
    if n == 0:
        return 0
    differ = np.nonzero(np.asarray(cached[:n]) != history[:n])[0]
    return int(differ[0]) if len(differ) else n


def request_ids_of(batch: ProposalBatch, method: str) -> list[str]:
    if batch.request_ids is None or len(batch.request_ids) != len(batch):
        raise ValueError(f"method {method} keeps a KV cache per request: ProposalBatch.request_ids must name each of "
                         f"the batch's {len(batch)} requests")
    return list(batch.request_ids)


class DraftModelProposer(CachedModelProposer):
    """`method: draft_model`: k greedy tokens per request from a draft model (module docstring)."""

    requires_model = True

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        if config.model is None:
            raise ConfigError(f"{FIELD}: method draft_model needs \"model\", the draft", field=FIELD)
        self.device = torch.device(context.device)
        self.dtype = getattr(torch, context.dtype)
        self.model: Any = None
        self.draft_config: ModelConfig | None = None
        self.max_len = context.max_model_len

    def load_model(self, target_model: Any) -> None:
        draft = self.context.draft_model_config or resolve_draft_model_config(str(self.config.model),
                                                                              dtype=self.context.dtype)
        self.draft_config = draft
        self.model = load_model(draft, device=self.device, quantization=self.context.draft_quantization)
        # The draft's rotary table ends at its own context length.
        self.max_len = min(self.context.max_model_len, draft.max_model_len)
        # Ids past either vocabulary are never drafted (checkpoints pad their tables differently).
        self.num_ids = min(self.context.vocab_size, draft.vocab_size)
        self.build_cache(self.model, self.max_len, "draft")

    def label(self) -> str:
        draft = self.draft_config
        return f"draft model {draft.architectures[0]} ({draft.model_dir})" if draft else super().label()

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Chunk], torch.Tensor]:
        """Run the draft over `chunks`; returns the chunks that fit and the greedy token after each."""
        fitted, positions, last_rows, metadata = self.loaded_cache().prepare(chunks)
        if not fitted:
            return fitted, torch.empty(0, dtype=torch.long)
        input_ids = torch.tensor([key for chunk in fitted for key in chunk.keys], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, metadata)
        logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        return fitted, logits[:, :self.num_ids].argmax(dim=-1).cpu()

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        request_ids = request_ids_of(batch, "draft_model")
        k = num_speculative_tokens
        drafts = np.zeros((len(batch), k), dtype=np.int64)
        counts = np.zeros(len(batch), dtype=np.int64)
        cache = self.loaded_cache()
        lengths = np.asarray(batch.num_tokens, dtype=np.int64)
        wanted = np.clip(np.minimum(self.max_len, self.context.max_model_len) - lengths, 0, k)
        chunks = []
        for i, request_id in enumerate(request_ids):
            n = int(lengths[i])
            if wanted[i] == 0 or n == 0:
                continue
            history = np.asarray(batch.token_ids[i, :n])
            cached, _ = cache.entries(request_id)
            keep = min(common_prefix(cached, history), n - 1)  # the last token's logits are needed
            chunks.append(Chunk(request_id, keep, history[keep:].tolist(), list(range(keep, n)),
                                reserve=int(wanted[i]) - 1))
        row_of = dict(zip(request_ids, range(len(request_ids))))
        for step in range(k):
            fitted, tokens = self._forward(chunks)
            chunks = []
            for chunk, token in zip(fitted, tokens.tolist()):
                i = row_of[chunk.request_id]
                drafts[i, step] = token
                counts[i] = step + 1
                if counts[i] < wanted[i]:
                    position = int(lengths[i]) + step
                    chunks.append(Chunk(chunk.request_id, position, [token], [position], continues_step=True))
            if not chunks:
                break
        return DraftTokens(token_ids=drafts, num_draft_tokens=counts)


__all__ = ["DraftModelProposer", "common_prefix", "request_ids_of", "resolve_draft_model_config"]
