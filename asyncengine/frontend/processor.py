"""InputProcessor: from a user's prompt and SamplingParams to engine-core requests, or a RequestError.

Everything a request can get wrong is caught here, in the frontend, before the engine core sees it:
the prompt's form and length, token ids outside the vocabulary, sampling values the engine cannot
honour (docs/sampling.md, "Limits": n at most max_n, top_k at or above the vocabulary is off, one
context-length rule for max_tokens and min_tokens). `n > 1` fans out into `n` engine-core requests
(children) that share the prompt and a parent id, by which the scheduler keeps one request's
completions to their share of the slots and of a step (docs/server.md, "Fairness"); the prompts of
one HTTP completions request join one such group (`new_group_id`, `ProcessedRequest.join_group`).
A multimodal model's prompt may carry images (`multi_modal_data`): they are checked and processed here
(frontend/multimodal.py) into the expanded prompt and one MultiModalFeature per image, which every
completion's EngineCoreRequest carries (docs/multimodal.md).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.errors import RequestError
from asyncengine.frontend.lora import LoRAAdapters
from asyncengine.frontend.multimodal import MultiModalInputs
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.sampling_bounds import INT64_MAX, INT64_MIN, RequestBounds
from asyncengine.sampling_params import SamplingParams, check_limits
from asyncengine.structured_output.backend import GrammarError
from asyncengine.structured_output.limits import SourceLimits
from asyncengine.structured_output.registry import backend_class_for_request
from asyncengine.config.structured_outputs import configured_backend_name
from asyncengine.structured_output_spec import GrammarSpec
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.interfaces.logits import LogitsProcessor
from asyncengine.worker.logits_processors import processor_name

logger = logging.getLogger(__name__)
_CHECKED_GRAMMARS = 1024  # grammars whose check is remembered (oldest forgotten first)


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the model's defaults filled in
    children: list[EngineCoreRequest]  # one per completion index

    def join_group(self, group: str) -> None:
        """Make this request's sequences part of `group` (InputProcessor.new_group_id): the prompts of one
        HTTP completions request, whose sequences together get one request's share of the slots."""
        self.children = [msgspec.structs.replace(child, parent_id=group) for child in self.children]


def child_request_id(request_id: str, index: int, n: int, submission: int) -> str:
    """The engine core's id of completion `index`: unique per submission, so a user's request id may
    be reused once the earlier request is gone (even while its last step is still in flight), and may
    look like another request's completion id without colliding with it."""
    return f"{submission}:{request_id}" if n == 1 else f"{submission}:{request_id}#{index}"


class InputProcessor:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, tokenizer: Any | None,
                 logits_processors: Sequence[type[LogitsProcessor]] = (),
                 multimodal: MultiModalInputs | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.tokenizer = tokenizer
        # The logits-processor classes (entry points and the `logits_processors` option): their
        # validate_params runs here, so a bad argument is a 400 rather than a dead worker.
        self.logits_processors = list(logits_processors)
        self._submissions = itertools.count()
        # The configuration's limits on SamplingParams (n, logprobs, token ids), checked in the server's words;
        # the context's (max_tokens, min_tokens) are checked with the prompt (`_max_tokens`, `process`).
        bounds = RequestBounds.of(engine_config, model_config)
        self.limits = {"max_n": bounds.max_n, "max_logprobs": bounds.max_logprobs, "max_token_id": bounds.max_token_id}
        # Structured outputs: the default backend is checked now (an unknown name fails start-up), and
        # each grammar is checked by its backend before the request is queued (a 400 naming the field).
        self.structured_outputs_backend = configured_backend_name(engine_config.structured_outputs_config)
        backend_class_for_request(self.structured_outputs_backend, per_request=False)
        self._checked_grammars: dict[str, None] = {}
        self.grammar_source_limits = SourceLimits.of(engine_config)
        # The adapters known by name, and the check of a request's adapter (frontend/lora.py).
        self.lora = LoRAAdapters(engine_config, served_model_name=model_config.served_model_name)
        # A multimodal model's image processing (frontend/multimodal.py); None: the model takes no images.
        self.multimodal = multimodal

    def new_group_id(self) -> str:
        """An id for the sequences of several requests that the scheduler counts as one
        (ProcessedRequest.join_group); never equal to another group's or a request's parent id."""
        return f"group-{next(self._submissions)}"

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams().with_defaults(self.model_config.generation_defaults)

    def process(self, request_id: str, prompt: Any, params: SamplingParams | None,
                lora_request: LoRARequest | None = None, priority: int = 0) -> ProcessedRequest:
        """`prompt` may carry vLLM's `cache_salt` (a dict prompt's key) and, for a multimodal model,
        `multi_modal_data` ({"image": ...}: processed here, so call this in the tokenizer pool); `priority` needs
        the priority scheduling policy (docs/server.md, "Priority"). A token-ids prompt's `mm_features` are its
        images already processed (what AsyncEngine.chat_prompt gives for a conversation with images)."""
        if lora_request is not None:
            self.lora.check(lora_request)
        if self.model_config.runner == "pooling":  # no LM head to sample from (docs/pooling.md)
            raise RequestError(f"{self.model_config.served_model_name} runs as a pooling model (--runner pooling): it "
                               "embeds, classifies and scores (LLM.embed, /v1/embeddings, ...) but generates nothing",
                               field="model")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", field="sampling_params"
            )
        self._check_priority(priority)
        cache_salt = _cache_salt(prompt)
        mm_features = _processed_features(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            prompt_text, token_ids, mm_features = self._multimodal_prompt(prompt)
        else:
            prompt_text, token_ids = self._tokenize(prompt)
        if mm_features and params.truncate_prompt_tokens is not None:
            raise RequestError("truncate_prompt_tokens cannot be used with images: cutting the prompt could cut an "
                               "image's tokens", field="truncate_prompt_tokens")
        token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        self._check_prompt(token_ids)
        params = params.with_defaults(self.model_config.generation_defaults)
        check_limits(params, self.limits)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)", field="stop")
        self._validate_with_logits_processors(params)
        max_tokens = self._max_tokens(params, len(token_ids))
        if params.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens={params.min_tokens} cannot be met: the prompt has {len(token_ids)} tokens, which leaves "
                f"room for {max_tokens} more under max_model_len ({self.model_config.max_model_len})"
                + ("" if params.max_tokens is None or params.max_tokens > max_tokens else
                   f" and max_tokens is {params.max_tokens}")
                + ": lower min_tokens", field="min_tokens",
            )
        vocab = self.model_config.vocab_size
        options = SamplingOptions(
            temperature=params.temperature,
            top_p=params.top_p,
            # top_k at or above the vocabulary keeps every token: that is top_k off.
            top_k=0 if params.top_k >= vocab else params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            eos_token_ids=() if params.ignore_eos else tuple(self.model_config.eos_token_ids),
            logprobs=params.logprobs,
            extra_args=params.extra_args,
            structured_outputs=self._grammar_spec(params),
            logit_bias=params.logit_bias,
            allowed_token_ids=None if params.allowed_token_ids is None else tuple(params.allowed_token_ids),
            bad_words_token_ids=self._bad_words_token_ids(params),
        )
        arrival = time.monotonic()
        submission = next(self._submissions)
        children = []
        for index in range(params.n):
            child_options = options
            if params.seed is not None and params.n > 1:
                # Each completion gets its own stream of randomness, reproducible from the seed.
                child_options = _replace_seed(options, child_seed(params.seed, index))
            children.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, index, params.n, submission),
                    prompt_token_ids=token_ids,
                    sampling=child_options,
                    arrival_time=arrival,
                    parent_id=f"{submission}:{request_id}" if params.n > 1 else None,
                    lora_request=lora_request,
                    priority=priority,
                    cache_salt=cache_salt,
                    mm_features=mm_features or None,
                )
            )
        return ProcessedRequest(request_id, prompt_text, token_ids, params, children)

    # -- checks ------------------------------------------------------------------------------------------

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise RequestError(f"priority must be an integer, got {priority!r}", field="priority")
        if priority != 0 and self.engine_config.scheduling_policy != "priority":
            raise RequestError(f"priority={priority} needs the server started with --scheduling-policy priority "
                               f"(it runs {self.engine_config.scheduling_policy}): send priority 0 or none",
                               field="priority")

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: the last max_model_len)."""
        if keep is None:
            return token_ids
        max_len = self.model_config.max_model_len
        if keep == -1:
            keep = max_len
        elif keep > max_len:
            raise RequestError(f"truncate_prompt_tokens={keep} exceeds max_model_len ({max_len})",
                               field="truncate_prompt_tokens")
        return token_ids[-keep:]

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "text prompts need a tokenizer, but the engine runs with skip_tokenizer_init: send "
                    "{'prompt_token_ids': [...]}",
                    field="prompt",
                )
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        raise RequestError(
            f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}", field="prompt"
        )

    def _multimodal_prompt(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """A prompt with `multi_modal_data`: its images checked and processed, its placeholders expanded."""
        if self.multimodal is None:  # never ignored silently: the model would not see the images
            raise RequestError(f"multi_modal_data is not supported by {self.model_config.served_model_name}: it is "
                               "not a multimodal model (it takes no images); send the text or token ids alone",
                               field="multi_modal_data")
        images = self.multimodal.images_of(prompt["multi_modal_data"])
        if "prompt_token_ids" in prompt:
            token_ids, features = self.multimodal.process(None, _token_ids(prompt["prompt_token_ids"]), images)
            return prompt.get("prompt"), token_ids, features
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise RequestError("a prompt with multi_modal_data has a 'prompt' string or 'prompt_token_ids'",
                               field="prompt")
        token_ids, features = self.multimodal.process(text, None, images)
        return text, token_ids, features

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty", field="prompt")
        error = context_length_error(len(token_ids), None, self.model_config.max_model_len)
        if error is not None:
            raise error
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise RequestError(
                f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", field="prompt_token_ids"
            )

    def _max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        """The context-length rule (docs/sampling.md): a max_tokens the caller set that does not fit in
        max_model_len with the prompt is refused; one the caller left alone (vLLM's 16, or the model's
        generation_config.json) is capped at the room left; None means all the room left."""
        room = self.model_config.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if "max_tokens" in params.explicit_fields:
            error = context_length_error(prompt_len, params.max_tokens, self.model_config.max_model_len)
            if error is not None:
                raise error
        return min(params.max_tokens, room)

    def _bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token sequences, as vLLM tokenizes them: the word (leading whitespace
        stripped) alone, and with one leading space when that gives a different first token and as many
        tokens (the word inside a text rather than at its start). Tokenizing runs where `process` runs:
        in the tokenizer pool for requests that AsyncEngine takes (process_request_async)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise RequestError("bad_words need a tokenizer (the engine runs with skip_tokenizer_init)",
                               field="bad_words")
        vocab = self.model_config.vocab_size
        sequences: list[tuple[int, ...]] = []
        for word in params.bad_words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise RequestError(f"bad_words: {word!r} gives no tokens", field="bad_words")
            for ids in (bare, spaced) if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else (bare,):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise RequestError(f"bad_words: {word!r} tokenizes to token id {bad}, outside the model's "
                                       f"vocabulary (0..{vocab - 1})", field="bad_words")
                if ids not in sequences:
                    sequences.append(ids)
        return tuple(sequences)

    def _grammar_spec(self, params: SamplingParams) -> GrammarSpec | None:
        """The request's constraint, within the source limits and checked by its backend (parsing only: no
        tokenizer; the engine core compiles it). Checked grammars are remembered, so a repeated one costs nothing.
        Parsing a large one takes a while: AsyncEngine.process_request_async calls this in its tokenizer pool."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer (the engine runs with skip_tokenizer_init)",
                               field="structured_outputs")
        spec = params.structured_outputs.to_spec()
        name = spec.backend or self.structured_outputs_backend
        cls = backend_class_for_request(name, per_request=spec.backend is not None)
        key = spec.cache_key(name)
        if key not in self._checked_grammars:
            self.grammar_source_limits.check(spec)  # before the backend parses it (limits.py: parsing can be slow)
            try:
                cls.validate(spec)
            except ValueError as exc:
                raise GrammarError(name, spec, str(exc)) from exc
            if len(self._checked_grammars) >= _CHECKED_GRAMMARS:
                self._checked_grammars.pop(next(iter(self._checked_grammars)))
            self._checked_grammars[key] = None
        return spec

    def _validate_with_logits_processors(self, params: SamplingParams) -> None:
        for cls in self.logits_processors:
            try:
                cls.validate_params(params)
            except RequestError as exc:
                if exc.source is None:  # the processor's own verdict, naming its field; the server names the class
                    exc.source = f"logits processor {processor_name(cls)}"
                raise
            except Exception as exc:
                # Plugin code raised something else: refuse this request, naming the class, and keep
                # serving the others. A ValueError is how vLLM processors say "bad arguments"; anything
                # else may be a bug in the plugin, so it is also logged with its traceback.
                if not isinstance(exc, ValueError):
                    logger.warning("logits processor %s raised in validate_params", processor_name(cls),
                                   exc_info=True)
                raise RequestError(
                    f"logits processor {processor_name(cls)} rejected the request: {type(exc).__name__}: {exc}",
                    field="extra_args",
                ) from exc


def context_length_error(prompt_len: int, max_tokens: int | None, max_model_len: int) -> RequestError | None:
    """The context-length rule: the prompt must leave room for one token, and an explicit max_tokens
    must fit after the prompt. Its errors carry OpenAI's code for it, which the server answers with."""
    if prompt_len >= max_model_len:
        return RequestError(
            f"the prompt is {prompt_len} tokens long, but max_model_len is {max_model_len} and at least one token "
            "must be generated: shorten the prompt or raise max_model_len", field="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        return RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} and "
            f"max_tokens asks for {max_tokens} more: lower max_tokens (or leave it unset for all the room left) "
            "or shorten the prompt", field="max_tokens", code="context_length_exceeded",
        )
    return None


def child_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: `seed + index`, wrapped into int64 (the engine's type for seeds)."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _replace_seed(options: SamplingOptions, seed: int) -> SamplingOptions:
    return msgspec.structs.replace(options, seed=seed)


def _processed_features(prompt: Any) -> list[MultiModalFeature] | None:
    """A dict prompt's `mm_features`: images processed already, beside the expanded `prompt_token_ids`."""
    features = prompt.get("mm_features") if isinstance(prompt, dict) else None
    if features is None:
        return None
    if (not isinstance(features, list) or not all(isinstance(f, MultiModalFeature) for f in features)
            or "prompt_token_ids" not in prompt or prompt.get("multi_modal_data") is not None):
        raise RequestError("mm_features are MultiModalFeatures from AsyncEngine.chat_prompt, beside the prompt_token_ids "
                           "they were expanded into; send images as multi_modal_data instead", field="mm_features")
    return features


def _token_ids(token_ids: Any) -> list[int]:
    if not isinstance(token_ids, (list, tuple)):
        raise RequestError("prompt_token_ids must be a list of integers", field="prompt_token_ids")
    try:  # checked and copied in C: a Python loop over a long prompt blocks the event loop
        return msgspec.convert(token_ids, list[int])  # (bools refused)
    except msgspec.ValidationError as exc:
        raise RequestError(f"prompt_token_ids must be a list of integers: {exc}", field="prompt_token_ids") from exc


def _cache_salt(prompt: Any) -> str | None:
    """A dict prompt's `cache_salt` (vLLM's key): a non-empty string, or absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(f"cache_salt must be a non-empty string, got {salt!r}", field="cache_salt")
    return salt
