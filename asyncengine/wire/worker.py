"""Engine core <-> worker messages: what to compute this step, and what was sampled.

As in vLLM v1, a request's full data is sent once (`NewRequestData`); afterwards only what changed
(`CachedRequestData`). The worker keeps the tokens it sampled itself, so they never travel back in.
"""

from __future__ import annotations

import msgspec

from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.wire.pooling import PooledTensor, PoolingOptions


class NewRequestData(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    # Output tokens already sampled: non-empty when a preempted request resumes.
    output_token_ids: list[int]
    sampling: SamplingOptions
    block_ids: list[int]  # its blocks in the first KV cache group (wire/kv_cache.py), the only one without sliding windows
    num_computed_tokens: int
    pooling: PoolingOptions | None = None  # a pooling request: pooled after its prefill, never sampled
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    extra_group_block_ids: list[list[int]] | None = None  # the other groups' blocks, in the layout's order
    # Its images (one per item, prompt order; wire/multimodal.py): the worker runs the vision tower on the
    # ones a step's `scheduled_encoder_inputs` names and merges their embeddings at their positions.
    mm_features: list[MultiModalFeature] | None = None


class CachedRequestData(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    extra_group_block_ids: list[list[int]] | None = None  # the other KV cache groups' new blocks


class GrammarBitmask(msgspec.Struct, frozen=True, kw_only=True):
    """The token masks of this step's constrained requests (those in `request_ids` that sample in it):
    `words` holds len(request_ids) rows of `num_words` little-endian int32 words, bit t % 32 of word
    t // 32 set when token t is allowed (asyncengine/structured_output/backend.py)."""

    request_ids: list[str]
    words: bytes
    num_words: int


class SchedulerOutput(msgspec.Struct, kw_only=True):
    new_requests: list[NewRequestData] = msgspec.field(default_factory=list)
    cached_requests: list[CachedRequestData] = msgspec.field(default_factory=list)
    # Request id -> number of tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # Requests the worker should forget (finished, aborted or preempted since the last step).
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    # The KV connector's metadata for this step (its scheduler side's Struct, msgpack-encoded; each
    # worker's side decodes it as its metadata_cls); None without a connector or with nothing to do.
    kv_connector_metadata: bytes | None = None
    # Structured outputs: the masks the worker applies to these requests' logits before sampling.
    grammar_bitmask: GrammarBitmask | None = None
    # Structured outputs with async scheduling (structured_output/deferred.py): this step's sampling
    # requests whose masks come after the step was submitted, through the executor's DeferredMask
    # (their previous token was still in flight). None: the masks, if any, are in `grammar_bitmask`.
    deferred_grammar_request_ids: list[str] | None = None
    # Pipeline micro-batches (engine_core/micro_batches.py): per cached request, its tokens from
    # max(num_computed_tokens, prompt length) on, for the stages that did not sample them; None: the
    # last stage broadcasts its sampled tokens instead (one step at a time).
    pipeline_token_ids: dict[str, list[int]] | None = None
    # Multimodal (vLLM's names): per request, the indices of its mm_features whose embeddings the worker computes
    # in this step (the first step that touches their placeholder tokens), kept in the worker's encoder cache
    # under their identifiers; and the identifiers the worker drops before this step (no request needs them).
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = msgspec.field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class StepTimings(msgspec.Struct, array_like=True):
    """Where one step's time went inside the worker (seconds).

    `prepare`: building the model inputs and queueing their copies to the device; `forward`: the host
    time of the forward pass (on a GPU, mostly launching kernels, unless a launch has to wait);
    `sample`: logits, sampling and the read-back of the tokens, which on a GPU also waits for the
    forward pass to finish; `device_forward`: the forward pass measured on the device with events
    (-1 where there are none, e.g. on CPU, where `forward` is already the compute time);
    `cuda_graph`: the forward pass was replayed from a captured CUDA graph.
    """

    prepare: float
    forward: float
    sample: float
    device_forward: float = -1.0
    cuda_graph: bool = False


class FailedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request the worker could not take (its sampling values, a logits processor's per-request
    check): it alone fails, with this message; the step goes on for the others."""

    request_id: str
    message: str
    field: str | None = None  # the request field to blame, when one is


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Requests that sampled this step (those whose scheduled tokens reached their end), in batch order."""

    request_ids: list[str] = msgspec.field(default_factory=list)
    sampled_token_ids: list[int] = msgspec.field(default_factory=list)
    # Parallel to request_ids when any request asked for logprobs: sampled token first, then the top-N.
    logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # When the worker started and finished the step (time.monotonic, the same clock in every local
    # process): the engine core's step trace shows what overlapped it.
    started_at: float = 0.0
    finished_at: float = 0.0
    timings: StepTimings | None = None
    # Requests failed this step instead of running (the scheduler finishes them with "error").
    failed_requests: list[FailedRequest] = msgspec.field(default_factory=list)
    # Pooling requests whose prompt this step finished, in batch order, and their outputs.
    pooled_request_ids: list[str] = msgspec.field(default_factory=list)
    pooled: list[PooledTensor] = msgspec.field(default_factory=list)
    # Mixture-of-experts models: tokens routed to each expert since the worker started, summed over its MoE
    # layers (the engine core puts them in its SchedulerStats); None for a model without experts.
    expert_tokens: list[int] | None = None
