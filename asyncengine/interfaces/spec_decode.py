"""Speculative proposers: the interface a proposer implements, and the registry that names them
(docs/reference.md R13, docs/speculative_decoding.md).

A proposer drafts up to k tokens per request from what the request holds so far; the target model then
scores every drafted position in one forward and the rejection sampler keeps the longest prefix the
target agrees with (asyncengine/worker/spec_decode/rejection_sampler.py), so a proposer can only change
speed, never the output distribution. `speculative_config`'s `method` names the proposer through this
registry: `ngram` is built in (asyncengine/worker/spec_decode/ngram.py); a plugin adds one from a
general plugin, as it adds a model:

    register_proposer("my_method", "my_pkg.proposer:MyProposer")

No numpy or torch import here: `asyncengine.plugins_api` exports this module's names without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncengine.config.speculative import FIELD, MODEL_METHODS, SpeculativeConfig
from asyncengine.errors import ConfigError
from asyncengine.interfaces.registry import BUILT_IN, Registry, reads

if TYPE_CHECKING:
    import numpy as np
    import torch


# The start-up record naming a proposer's own KV cache (a draft's, a head's), beside the target's "KV cache".
PROPOSER_KV_CACHE = "speculative proposer KV cache"


@dataclass(frozen=True)
class ProposerContext:
    """What the engine tells a proposer when building it (one per worker): the target's vocabulary size
    (rows of its logits), its max_model_len, the most requests in one step, the device, and the target's
    tensor-parallel size (a draft model of draft_tensor_parallel_size 1 runs on rank 0 only)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    device: str = "cpu"
    tensor_parallel_size: int = 1
    # For proposers with a model of their own (a draft, an EAGLE head): the dtype its weights and KV cache
    # take (the target's), the KV block size, the worker's platform class (it chooses the attention backend;
    # None: TORCH_PAGED), the draft's resolved ModelConfig (None: resolved from speculative_config.model by
    # the proposer), the bytes its own KV cache may take (None: enough for max_num_seqs requests of
    # max_model_len tokens), and the draft's quantization method (None: its weights as its files give them,
    # dequantized for a GGUF file; "gguf": a GGUF draft's quantized blocks, as the target's option says).
    dtype: str = "float32"
    block_size: int = 16
    platform: Any = None
    draft_model_config: Any = None
    draft_kv_cache_bytes: int | None = None
    draft_quantization: str | None = None
    # True when the engine sizes the proposer's own KV cache beside the target's (`kv_cache_bytes_per_block`,
    # then `initialize_kv_cache` with the target's block count); False: the proposer allocates it in
    # `load_model` (room for max_num_seqs requests of max_model_len tokens), as when it runs on its own.
    kv_cache_sized_by_engine: bool = False


@dataclass
class ProposalBatch:
    """The requests to draft for in one step, row i being request i.

    token_ids: `[num_requests, width]` int array (numpy), each row a request's tokens so far (prompt then
        output, the token sampled last included), left-aligned; what lies past `num_tokens[i]` is not read.
    num_tokens: `[num_requests]` the length of each row's history.
    request_ids: the requests' ids, for a proposer that keeps per-request state (a draft's KV cache).
    hidden_states: the target's hidden states for the positions just computed (`[num_positions, hidden]`,
        torch), for proposers that set `needs_target_hidden_states` (EAGLE); None otherwise. With
        `aux_hidden_state_layers` (EAGLE-3), each row is those layers' states concatenated, in that order.
    num_hidden_states: `[num_requests]` how many rows of `hidden_states` are request i's (consecutive, request
        after request): the target's states at history positions `num_tokens[i] - 1 - num_hidden_states[i]`
        to `num_tokens[i] - 2` (position j's state is what the target computed from token j, the one that
        scored token j + 1; the last token of the history has none yet). None: one row per request.
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    request_ids: list[str] | None = None
    hidden_states: torch.Tensor | None = None
    num_hidden_states: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.num_tokens)


@dataclass
class DraftTokens:
    """A proposer's answer: `token_ids` `[num_requests, k]` int64 (numpy), of which the first
    `num_draft_tokens[i]` of row i are drafts (0: no draft for that request this step; the rest is
    padding, never read); `probs`, for proposers with `has_draft_probs`, `[num_requests, k, vocab]`
    (torch) the distribution each draft was drawn from, else None: each draft is then taken as certain
    (one-hot), which is right for a draft chosen deterministically (a lookup, a greedy draft model)."""

    token_ids: np.ndarray
    num_draft_tokens: np.ndarray
    probs: torch.Tensor | None = None

    def as_lists(self) -> list[list[int]]:
        """The drafts of each request as a list of token ids."""
        return [row[:count].tolist() for row, count in zip(self.token_ids, self.num_draft_tokens.tolist())]


class Proposer:
    """Subclass it, implement `propose`, and register the class (or its "pkg.mod:Class" path) with
    `register_proposer("METHOD", ...)` from a general plugin (the worker builds it; the frontend checks
    the method's name).

    Built once per worker as `cls(config, context)`. A proposer with a model of its own loads it in
    `load_model(target_model)` (called once, after the target is loaded: an EAGLE head shares the
    target's embeddings and head, a draft model loads its own weights)."""

    # Whether `propose` reads `batch.hidden_states` (the target must then keep them for the step).
    needs_target_hidden_states: bool = False
    # Whether drafts come with the distribution they were drawn from (DraftTokens.probs).
    has_draft_probs: bool = False
    # Whether speculative_config must name a model for this method.
    requires_model: bool = False
    # The target layers whose hidden states `batch.hidden_states` must carry, concatenated in this order (the
    # residual stream entering each layer, as vLLM's aux hidden states; EAGLE-3 reads three); empty: the
    # target's final hidden states (after its last norm). Final once `load_model` returned.
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        self.config = config
        self.context = context

    def load_model(self, target_model: Any) -> None:
        """Load what the proposer runs (nothing, for a lookup)."""

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        """Up to `num_speculative_tokens` drafts for each request of `batch`."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement propose(batch, num_speculative_tokens)")

    def remove(self, request_ids: list[str]) -> None:
        """Forget what is kept for these requests (finished, aborted or preempted): a draft's KV cache. The
        worker calls it when the scheduler drops them; a proposer without per-request state has nothing to do."""

    def describe(self) -> str | None:
        """A line for the start-up report (what it loaded, its KV cache's size), or None."""
        return None

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the proposer's own KV cache per block of `block_size` tokens (0: it keeps none). The engine
        takes the target's and the proposer's caches out of one KV budget, a proposer block per target block."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's own KV cache: `num_blocks` blocks, the target's count (called once, after
        `load_model`, when `ProposerContext.kv_cache_sized_by_engine`)."""

    def kv_cache_usage(self) -> dict[str, int] | None:
        """`{"num_blocks", "num_free_blocks", "num_requests"}` of its own KV cache (None: it keeps none)."""
        return None


# The built-in proposers, by path (the floor imports no worker code).
BUILTIN_PROPOSERS = {
    "ngram": "asyncengine.worker.spec_decode.ngram:NgramProposer",
    "draft_model": "asyncengine.worker.spec_decode.draft_model:DraftModelProposer",
    "eagle": "asyncengine.worker.spec_decode.eagle:EagleProposer",
    "eagle3": "asyncengine.worker.spec_decode.eagle:Eagle3Proposer",
}


class _ProposerRegistry(Registry[type[Proposer]]):
    def __init__(self) -> None:
        super().__init__("proposers", "speculative proposer", Proposer, field=FIELD)
        for name, path in BUILTIN_PROPOSERS.items():
            self.register(name, path, owner=BUILT_IN)

    def register_proposer(self, method: str, proposer: Any, *, override: bool = False) -> None:
        self.register(method, proposer, override=override)

    def _unknown(self, method: Any) -> ConfigError:
        # Worded here rather than by the table's `unknown` template: which of vLLM's methods are still to
        # come depends on what is registered when it is asked.
        coming = [name for name in MODEL_METHODS if name not in self]
        later = (f"; not built yet: vLLM's {', '.join(coming)} (docs/speculative_decoding.md)" if coming else "")
        return ConfigError(f"{FIELD}.method {method!r} is not a registered proposer; registered: "
                           f"{', '.join(self.keys())}{later} (a plugin adds one with register_proposer, from a "
                           "general plugin so that the worker processes have it too)", field=FIELD)

    @reads("proposers", "worker")
    def proposer_class(self, method: str) -> type[Proposer]:
        """The class registered under `method`; an unknown name lists the registered ones."""
        if not isinstance(method, str) or method not in self:
            raise self._unknown(method)
        return self.load(method)

    @reads("proposers", "frontend")
    def check_method(self, config: SpeculativeConfig) -> None:
        """The frontend's start-up check of `speculative_config` against the registry: the method is
        registered, and a proposer that needs a model is given one."""
        proposer = self.proposer_class(config.method)
        if proposer.requires_model and config.model is None:
            raise ConfigError(f"{FIELD}: method {config.method} ({proposer.__qualname__}) needs \"model\"",
                              field=FIELD)


ProposerRegistry = _ProposerRegistry()


def register_proposer(method: str, proposer: Any, *, override: bool = False) -> None:
    """`register_proposer("METHOD", "pkg.mod:Proposer")` (or the class): a proposer speculative_config's
    `method` can name."""
    ProposerRegistry.register_proposer(method, proposer, override=override)


__all__ = ["BUILTIN_PROPOSERS", "PROPOSER_KV_CACHE", "DraftTokens", "ProposalBatch", "Proposer", "ProposerContext",
           "ProposerRegistry", "register_proposer"]
