"""The EAGLE and EAGLE-3 proposers (vLLM's `method: eagle` / `eagle3`): a draft head (eagle_heads.py) fed the
target's hidden states drafts k greedy tokens per request, on a KV cache of its own.

What the head is given, per request (ProposalBatch.hidden_states / num_hidden_states): the target's states at
the history positions it computed since the last step (EAGLE: its final hidden states; EAGLE-3: the residual
stream entering each layer of `aux_hidden_state_layers`, concatenated). Head row j takes (token j + 1, the
target's state j) and predicts token j + 2, so the last given row predicts the token after the history: the
first draft. Each further draft is one more row: (the draft just made, the head's own output state for the
row before). The head's KV cache (proposer_cache.py) holds a row per position it was fed; positions from the
first one given this step on are recomputed (the previous step's draft rows, which the target has now
replaced with its own states). A request given no hidden states this step drafts nothing.

Where the target's embedding (and, for EAGLE, its lm_head) comes from: the target model's
`model.embed_tokens` and `compute_logits`, as vLLM shares them; a head whose checkpoint has its own
`embed_tokens.weight` uses that instead.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from asyncengine.config.model import complete_hf_config, load_config_json
from asyncengine.config.speculative import FIELD, SpeculativeConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.interfaces.spec_decode import DraftTokens, ProposalBatch, ProposerContext
from asyncengine.loader.safetensors_weights import find_weight_files, iterate_weights
from asyncengine.worker.spec_decode.draft_model import request_ids_of
from asyncengine.worker.spec_decode.eagle_heads import Eagle3Head, EagleHead, weight_names
from asyncengine.worker.spec_decode.proposer_cache import CachedModelProposer, Chunk



def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's EAGLE-3 default: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _head_config(path: Path) -> Any:
    if not path.is_dir():
        raise ConfigError(f"{FIELD}.model {str(path)!r} must be the EAGLE head's directory (config.json and "
                          "*.safetensors)", field=FIELD)
    return SimpleNamespace(**complete_hf_config(path, load_config_json(path), {}))


def _target_parts(target_model: Any, method: str) -> tuple[Any, Any, int]:
    """(the target's embedding, its compute_logits, its layer count)."""
    inner = getattr(target_model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    compute_logits = getattr(target_model, "compute_logits", None)
    config = getattr(target_model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if embedding is None or compute_logits is None or layers is None:
        raise ConfigError(f"{FIELD}: method {method} shares the target's embedding and head, and reads its layer "
                          f"count: the target ({type(target_model).__name__}) must have model.embed_tokens, "
                          "compute_logits and config.num_hidden_layers (the native architectures here do)",
                          field=FIELD)
    return embedding, compute_logits, int(layers)


class EagleProposer(CachedModelProposer):
    """`method: eagle` (module docstring)."""

    requires_model = True
    needs_target_hidden_states = True
    method = "eagle"

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        self.device = torch.device(context.device)
        self.dtype = getattr(torch, context.dtype)
        self.head: Any = None
        self.target_embedding: Any = None
        self.target_logits: Any = None

    # -- loading ------------------------------------------------------------------------------------------

    def build_head(self, head_config: Any, names: set[str], num_target_layers: int) -> Any:
        return EagleHead(head_config, dtype=self.dtype, max_position=self.context.max_model_len,
                         own_embedding="embed_tokens.weight" in names or "model.embed_tokens.weight" in names,
                         fc_bias="fc.bias" in names or "fusion_fc.bias" in names)

    def load_model(self, target_model: Any) -> None:
        path = Path(str(self.config.model)).expanduser()
        head_config = _head_config(path)
        self.target_embedding, self.target_logits, num_layers = _target_parts(target_model, self.method)
        files = find_weight_files(path)
        with torch.device(self.device):
            self.head = self.build_head(head_config, weight_names(files), num_layers)
        self.head.load_weights(iterate_weights(files))
        self.head.to(self.device).eval()
        self.check_head()
        self.build_cache(self.head, self.context.max_model_len, f"{self.method} head")

    def label(self) -> str:
        return f"{self.method} head {self.config.model}"

    def check_head(self) -> None:
        """What the loaded head must agree on with the target (EAGLE: nothing beyond the shapes loaded)."""

    # -- drafting -----------------------------------------------------------------------------------------

    def greedy(self, for_logits: torch.Tensor) -> torch.Tensor:
        """The target ids of the head's argmax, one per row."""
        logits = self.target_logits(for_logits)
        return logits[:, :self.context.vocab_size].argmax(dim=-1)

    def _forward(self, chunks: list[Chunk], hidden: dict[str, torch.Tensor],
                 tokens: dict[str, list[int]]) -> tuple[list[Chunk], torch.Tensor, torch.Tensor]:
        """Run the head over `chunks` (their input tokens and hidden rows by request id); returns the chunks
        that fit, the draft after each (target ids, on the host) and each one's last output state."""
        fitted, positions, last_rows, metadata = self.loaded_cache().prepare(chunks)
        if not fitted:
            return fitted, torch.empty(0, dtype=torch.long), torch.empty(0)
        input_ids = torch.tensor([t for chunk in fitted for t in tokens[chunk.request_id]], dtype=torch.long,
                                 device=self.device)
        rows = torch.cat([hidden[chunk.request_id] for chunk in fitted]).to(self.device)
        for_logits, fed_back = self.head(input_ids, positions, rows, metadata, self.target_embedding)
        return fitted, self.greedy(for_logits.index_select(0, last_rows)).cpu(), fed_back.index_select(0, last_rows)

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        request_ids = request_ids_of(batch, self.method)
        k = num_speculative_tokens
        drafts = np.zeros((len(batch), k), dtype=np.int64)
        counts = np.zeros(len(batch), dtype=np.int64)
        cache = self.loaded_cache()
        if batch.hidden_states is None:
            raise ValueError(f"method {self.method} drafts from the target's hidden states: ProposalBatch.hidden_states "
                             "is required (needs_target_hidden_states)")
        lengths = np.asarray(batch.num_tokens, dtype=np.int64)
        given = (np.ones(len(batch), dtype=np.int64) if batch.num_hidden_states is None
                 else np.asarray(batch.num_hidden_states, dtype=np.int64))
        if int(given.sum()) != batch.hidden_states.shape[0] or (given > np.maximum(lengths - 1, 0)).any():
            raise ValueError(f"ProposalBatch: {batch.hidden_states.shape[0]} rows of hidden states for "
                             f"num_hidden_states {given.tolist()} (at most num_tokens - 1 each: {lengths.tolist()})")
        starts = np.concatenate([[0], np.cumsum(given)])
        wanted = np.clip(self.context.max_model_len - lengths, 0, k)
        chunks, hidden, tokens = [], {}, {}
        for i, request_id in enumerate(request_ids):
            n, m = int(lengths[i]), int(given[i])
            if m == 0 or wanted[i] == 0:
                continue
            first = n - 1 - m  # the first position given
            _, cached_positions = cache.entries(request_id)
            keep = bisect.bisect_left(cached_positions, first)
            positions = list(range(first, n - 1))
            chunks.append(Chunk(request_id, keep, positions, positions, reserve=int(wanted[i]) - 1))
            hidden[request_id] = batch.hidden_states[starts[i]:starts[i + 1]]
            tokens[request_id] = np.asarray(batch.token_ids[i, first + 1:n]).tolist()
        row_of = {request_id: i for i, request_id in enumerate(request_ids)}
        for step in range(k):
            fitted, drafted, fed_back = self._forward(chunks, hidden, tokens)
            chunks, hidden, tokens = [], {}, {}
            for index, (chunk, token) in enumerate(zip(fitted, drafted.tolist())):
                i = row_of[chunk.request_id]
                drafts[i, step] = token
                counts[i] = step + 1
                if counts[i] < wanted[i]:
                    position = int(lengths[i]) - 1 + step  # the row fed the draft just made
                    chunks.append(Chunk(chunk.request_id, position, [position], [position], continues_step=True))
                    hidden[chunk.request_id] = fed_back[index:index + 1]
                    tokens[chunk.request_id] = [token]
            if not chunks:
                break
        return DraftTokens(token_ids=drafts, num_draft_tokens=counts)


class Eagle3Proposer(EagleProposer):
    """`method: eagle3` (module docstring): the head's own lm_head over its draft vocabulary, mapped to the
    target's ids by d2t; reads `aux_hidden_state_layers` of the target (the head config's
    `eagle_aux_hidden_state_layer_ids`, else vLLM's default 2, L // 2, L - 3)."""

    method = "eagle3"

    def build_head(self, head_config: Any, names: set[str], num_target_layers: int) -> Any:
        eagle_config = getattr(head_config, "eagle_config", None) or {}
        layers = (getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
                  or eagle_config.get("eagle_aux_hidden_state_layer_ids")
                  or default_aux_layers(num_target_layers))
        layers = tuple(int(layer) for layer in layers)
        if len(layers) != 3 or not all(0 <= layer < num_target_layers for layer in layers):
            raise ModelLoadError(f"the EAGLE-3 head reads the target's layers {list(layers)}: three layers of the "
                                 f"target's {num_target_layers} are needed")
        self.aux_hidden_state_layers = layers
        target_hidden = int(getattr(head_config, "target_hidden_size", None) or head_config.hidden_size)
        return Eagle3Head(head_config, dtype=self.dtype, max_position=self.context.max_model_len,
                          own_embedding="embed_tokens.weight" in names or "model.embed_tokens.weight" in names,
                          target_hidden_size=target_hidden, has_d2t="d2t" in names)

    def greedy(self, for_logits: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(self.head.logits(for_logits).argmax(dim=-1))

    def check_head(self) -> None:
        mapped = self.head.draft_to_target(torch.arange(self.head.draft_vocab_size, device=self.head.d2t.device))
        if (mapped < 0).any() or (mapped >= self.context.vocab_size).any():
            raise ModelLoadError(f"the EAGLE-3 head's d2t maps draft ids outside the target's {self.context.vocab_size} "
                                 "token ids: is it the head of this target?")


__all__ = ["Eagle3Proposer", "EagleProposer", "default_aux_layers"]
