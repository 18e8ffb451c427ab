"""Frontend <-> engine core messages: requests in, per-step token outputs back."""

from __future__ import annotations

from typing import Any

import msgspec

from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.sampling_bounds import (
    Count, Int64, LogitBias, Penalty, PositiveCount, Probability, RepetitionPenalty, Temperature, TokenId, TopP,
)
from asyncengine.structured_output_spec import GrammarSpec
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.wire.pooling import PooledTensor, PoolingOptions


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine core and workers need of a request's SamplingParams, fully resolved.

    Stop strings, detokenization and `n` stay in the frontend; here `max_tokens` is a number (the
    frontend fills in the room left under max_model_len) and `eos_token_ids` lists every EOS id
    of the model (empty when the request set ignore_eos).

    The fields carry the bounds table's types (sampling_bounds.py), as SamplingParams does: a message that
    holds a value past them does not decode. The worker trusts what decodes: the frontend checked each
    value where it entered, the vocabulary's bounds included (top_k at or above the vocabulary is 0 here).
    """

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Count = 0
    min_p: Probability = 0.0
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    max_tokens: PositiveCount = 16
    min_tokens: Count = 0
    stop_token_ids: tuple[TokenId, ...] = ()
    eos_token_ids: tuple[TokenId, ...] = ()
    logprobs: Count | None = None
    # SamplingParams.extra_args, already checked to encode (and normalized to what msgpack decodes):
    # per-request arguments for logits processors, which read them in the worker.
    extra_args: dict[str, Any] | None = None
    # The constraint of SamplingParams.structured_outputs, resolved (the engine core compiles it and
    # computes the token masks; asyncengine/structured_output/).
    structured_outputs: GrammarSpec | None = None
    # SamplingParams.logit_bias, allowed_token_ids and bad_words, checked against the vocabulary; the bad
    # words as the token sequences the frontend's tokenizer gave (worker/logit_controls.py applies them).
    logit_bias: dict[TokenId, LogitBias] | None = None
    allowed_token_ids: tuple[TokenId, ...] | None = None
    bad_words_token_ids: tuple[tuple[TokenId, ...], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class EngineCoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float = 0.0
    # The sequences of one request (its `n` completions when n > 1, and over HTTP every prompt of one
    # completions request): an id they share, unique per submission. The scheduler holds them to their
    # share of the slots (and of a step's tokens while others wait): docs/server.md, "Fairness".
    parent_id: str | None = None
    # The LoRA adapter this request runs with (None: the base model); its id keys scheduling, the prefix
    # cache and the workers' adapter slots.
    lora_request: LoRARequest | None = None
    # A pooling request (docs/pooling.md): it finishes after its prefill with a pooled output, samples nothing.
    pooling: PoolingOptions | None = None
    # vLLM's: with --scheduling-policy priority, a lower value is admitted first and preempted last.
    priority: int = 0
    # vLLM's: roots the chain of prefix-cache block hashes, so requests with different salts never share blocks.
    cache_salt: str | None = None
    # The prompt's images (docs/multimodal.md), in prompt order; None for a text-only prompt.
    mm_features: list[MultiModalFeature] | None = None


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The request alone failed in a worker (EngineCoreOutput.error says why); the engine goes on.
    ERROR = "error"


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: the sampled token first, then the top-N, as (token ids, logprobs).
    new_logprobs: list[tuple[list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # With finish_reason "error": what went wrong for this request, and the request field to blame.
    error: str | None = None
    error_field: str | None = None
    # A pooling request's output (it finishes in the same step, with finish_reason "stop").
    pooled: PooledTensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0  # the KV cache's blocks (vLLM's num_gpu_blocks), for cache_config_info
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Totals since the engine started. Prompt tokens computed in prefill steps (a preempted request's
    # recomputation counts again), and prompt tokens whose KV a KV connector supplied instead.
    num_prompt_tokens_computed: int = 0
    num_kv_connector_loaded_tokens: int = 0
    # The compiled-grammar cache (structured_output/compiling.py): what its grammars hold, and how many.
    structured_outputs_cache_bytes: int = 0
    structured_outputs_cache_entries: int = 0
    # Multimodal items whose encoder outputs the workers hold now (engine_core/encoder_cache.py), and their rows.
    encoder_cache_entries: int = 0
    encoder_cache_rows: int = 0
    # Mixture-of-experts models: tokens routed to each expert since the engine started, summed over the MoE
    # layers (of the stage that samples, with pipeline parallelism); None for a model without experts.
    expert_tokens: list[int] | None = None
    # With data parallelism (frontend/dp_router.py): the engine core these stats are of, and in the
    # frontend's sum over engine cores (get_scheduler_stats) each one's own, for /metrics' engine label.
    engine_index: int = 0
    engines: list[SchedulerStats] | None = None


class EngineCoreOutputs(msgspec.Struct, kw_only=True, tag=True):
    """Everything one engine step produced: it travels as one message."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    num_scheduled_tokens: int = 0
    # Requests the scheduler started running for the first time since the previous message: the
    # frontend's bound on waiting requests counts them as no longer waiting.
    admitted_request_ids: list[str] = msgspec.field(default_factory=list)
    # Seconds from scheduling this step to sending its outputs, in the engine core: the frontend places
    # the step's start on its own clock from it (a duration, so the processes' clocks never meet).
    step_seconds: float = 0.0
