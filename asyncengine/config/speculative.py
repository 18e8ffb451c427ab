"""`speculative_config`: which proposer drafts tokens for the target model to verify, and how many.

vLLM's JSON shape (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'`), typed
as `SpeculativeConfig` and checked here, in the floor, when it is parsed: the shape, the ranges, the keys
each method takes. What needs more than the config is checked where that is known: the method's name
against the proposer registry (asyncengine/interfaces/spec_decode.py, once plugins are loaded), the
draft's tensor-parallel size and k against the engine's options (`check_against_engine`), the draft's
vocabulary against the target's (asyncengine/config/draft_vocabulary.py, once both models are resolved).

`EngineConfig.speculative_config` is the field (with the description below, `SPECULATIVE_CONFIG_DESCRIPTION`),
and the CLI derives `--speculative-config` from it; `EngineConfig.speculative` is the parsed value.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from asyncengine.config.help import doc
from asyncengine.errors import ConfigError

FIELD = "speculative_config"

# vLLM's built-in method names that draft with a model of their own (the draft, or an EAGLE head): they
# need `model`. "mtp" drafts with the target's own MTP layers, so its model defaults to the target.
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3")
MODEL_METHODS = (*DRAFT_MODEL_METHODS, "mtp")
NGRAM = "ngram"
# vLLM spells the n-gram model `ngram` or `[ngram]` (its older form); either names no model to load.
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")

# vLLM sets no upper bound. Each step verifies k + 1 positions per request, and a draft's position i is
# accepted only when all before it were, so past a few dozen the extra positions are nearly always
# rejected work; 32 is vLLM's MAX_SPEC_LEN, the longest its rejection kernels take.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's default lookup window when neither bound is given (its own note calls the value untuned).
DEFAULT_PROMPT_LOOKUP = 5

SPECULATIVE_CONFIG_DESCRIPTION = (
    "Speculative decoding: {\"method\": ngram | draft_model | eagle | eagle3 | a registered proposer, "
    "\"num_speculative_tokens\": k, \"model\": the draft, \"prompt_lookup_min\", \"prompt_lookup_max\", "
    "\"draft_tensor_parallel_size\", \"quantization\"}.")

# vLLM's keys that are not built here, with what to do instead (a key nobody knows is refused too).
_UNSUPPORTED_VLLM_KEYS = {
    "tensor_parallel_size": "give draft_tensor_parallel_size (vLLM warns about this key too)",
    "dtype": "the draft takes the target's dtype (as vLLM's draft does)",
    "max_model_len": "the draft runs to the target's max_model_len",
    "revision": "give the draft as a local directory or .gguf file",
    "code_revision": "give the draft as a local directory or .gguf file",
    "draft_sample_method": "drafts are greedy here (their probabilities are not kept)",
    "rejection_sample_method": "only vLLM's standard rejection sampling is built",
    "disable_padded_drafter_batch": "there is no padded drafter batch here",
    "enforce_eager": "the draft follows the engine's enforce_eager",
}


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The checked `speculative_config` (build it with `parse_speculative_config`)."""

    method: Annotated[str, doc(
        "The proposer, by registered name: ngram (prompt lookup), draft_model, eagle, eagle3, mtp, or a "
        "plugin's.")]
    num_speculative_tokens: Annotated[int, doc(
        f"Tokens proposed per request and step (k), 1 to {MAX_SPECULATIVE_TOKENS}.")]
    model: Annotated[str | None, doc(
        "The draft model or EAGLE head (a directory or .gguf file); none for ngram, the target's own "
        "layers for mtp.")] = None
    prompt_lookup_min: Annotated[int | None, doc(
        "ngram: the shortest suffix of the history that is looked up (tokens).")] = None
    prompt_lookup_max: Annotated[int | None, doc(
        "ngram: the longest suffix of the history that is looked up (tokens); the longest that matches "
        "wins.")] = None
    draft_tensor_parallel_size: Annotated[int | None, doc(
        "The draft model's tensor-parallel size: 1 or the target's; none: the target's.")] = None
    quantization: Annotated[str | None, doc(
        "draft_model: the draft's quantization method (as the engine's quantization option: int8, int8_dynamic, "
        "gguf for a .gguf draft's quantized blocks, or a plugin's); none: its weights as its files give them "
        "(a .gguf draft dequantized).")] = None

    @property
    def uses_draft_model(self) -> bool:
        """Whether the method loads weights of its own (a draft model or a head) beside the target's."""
        return self.method in DRAFT_MODEL_METHODS


KNOWN_KEYS = tuple(field.name for field in msgspec.structs.fields(SpeculativeConfig))


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{FIELD}.{key} must be a whole number, at least 1; got {value!r}", field=FIELD)
    return value


def _inferred_method(model: Any) -> str:
    """vLLM's choice when `method` is left out: from the model's name (ngram, EAGLE heads by their usual
    names), else a draft model."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{FIELD} needs \"method\" (ngram, draft_model, eagle, eagle3, mtp or a registered "
                          "proposer's name), or a \"model\" to infer it from", field=FIELD)
    name = model.lower()
    if model in _NGRAM_MODEL_NAMES:
        return NGRAM
    if "eagle3" in name:
        return "eagle3"
    if "eagle-" in name:
        return "eagle"
    return "draft_model"


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """The typed, checked view of `speculative_config` (None when unset); a ConfigError names what is
    wrong. `value` is the JSON object as a dict (or a SpeculativeConfig, returned as it is)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{FIELD} must be a JSON object with the keys {', '.join(KNOWN_KEYS)}; got {value!r}",
                          field=FIELD)
    for key in sorted(set(value) - set(KNOWN_KEYS)):
        why = _UNSUPPORTED_VLLM_KEYS.get(key)
        detail = f"vLLM's key {key!r} is not built here: {why}" if why else f"unknown key {key!r}"
        raise ConfigError(f"{FIELD}: {detail}; the keys are {', '.join(KNOWN_KEYS)}", field=FIELD)
    model = value.get("model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        raise ConfigError(f"{FIELD}.model must be a path to the draft model (a directory or .gguf file); got "
                          f"{model!r}", field=FIELD)
    method = value.get("method")
    if method is None:
        method = _inferred_method(model)
    if not isinstance(method, str) or not method.strip():
        raise ConfigError(f"{FIELD}.method must name a proposer (ngram, draft_model, eagle, eagle3, mtp or a "
                          f"registered one); got {method!r}", field=FIELD)
    method = NGRAM if method == "[ngram]" else method.strip()
    if "num_speculative_tokens" not in value or value["num_speculative_tokens"] is None:
        raise ConfigError(f"{FIELD}.num_speculative_tokens is required: the tokens proposed per step, 1 to "
                          f"{MAX_SPECULATIVE_TOKENS}", field=FIELD)
    k = value["num_speculative_tokens"]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{FIELD}.num_speculative_tokens must be a whole number from 1 to "
                          f"{MAX_SPECULATIVE_TOKENS}; got {k!r}", field=FIELD)
    draft_tp = value.get("draft_tensor_parallel_size")
    if draft_tp is not None:
        draft_tp = _positive_int(draft_tp, "draft_tensor_parallel_size")
    lookup_min, lookup_max = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    quantization = value.get("quantization")
    if quantization is not None and not (isinstance(quantization, str) and quantization.strip()):
        raise ConfigError(f"{FIELD}.quantization must name a quantization method (int8, int8_dynamic, gguf or a "
                          f"registered one); got {quantization!r}", field=FIELD)
    if method == NGRAM:
        if model is not None and model not in _NGRAM_MODEL_NAMES:
            raise ConfigError(f"{FIELD}: method ngram looks tokens up in the request's own history and loads no "
                              f"model; remove \"model\" ({model!r}) or choose method draft_model", field=FIELD)
        for key in ("draft_tensor_parallel_size", "quantization"):
            if value.get(key) is not None:
                raise ConfigError(f"{FIELD}: {key} applies to a draft model; method ngram has none", field=FIELD)
        model = None
        lookup_min, lookup_max = _lookup_window(lookup_min, lookup_max)
    elif method in MODEL_METHODS:
        given = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if value.get(key) is not None]
        if given:
            raise ConfigError(f"{FIELD}: {' and '.join(given)} apply to method ngram only, not {method}",
                              field=FIELD)
        if quantization is not None and method != "draft_model":
            raise ConfigError(f"{FIELD}: quantization applies to method draft_model; the {method} head's weights "
                              "are loaded as its safetensors give them", field=FIELD)
        if method in DRAFT_MODEL_METHODS and model is None:
            what = "the draft model" if method == "draft_model" else f"the {method.upper()} head"
            raise ConfigError(f"{FIELD}: method {method} needs \"model\": {what} (a directory or .gguf file)",
                              field=FIELD)
    else:  # a plugin's proposer: the lookup bounds are its to read, checked for shape only
        for key, bound in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if bound is not None:
                _positive_int(bound, key)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=model, prompt_lookup_min=lookup_min,
                             prompt_lookup_max=lookup_max, draft_tensor_parallel_size=draft_tp,
                             quantization=quantization)


def _lookup_window(lookup_min: Any, lookup_max: Any) -> tuple[int, int]:
    """ngram's (prompt_lookup_min, prompt_lookup_max), defaulted as vLLM does: both unset, 5 and 5; one
    unset, the other's value."""
    if lookup_min is None and lookup_max is None:
        return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
    low = _positive_int(lookup_min if lookup_min is not None else lookup_max, "prompt_lookup_min")
    high = _positive_int(lookup_max if lookup_max is not None else lookup_min, "prompt_lookup_max")
    if low > high:
        raise ConfigError(f"{FIELD}: prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})",
                          field=FIELD)
    return low, high


def check_against_engine(config: SpeculativeConfig, *, tensor_parallel_size: int, max_model_len: int,
                         max_num_batched_tokens: int) -> None:
    """What the engine's own options bound: the draft's TP (1 or the target's, as vLLM; a proposer with a
    model of its own runs only beside a target of TP 1 so far), and k, since one step verifies k + 1
    positions of a request within the step's token budget and the model's length."""
    draft_tp = config.draft_tensor_parallel_size
    if draft_tp is not None and draft_tp not in (1, tensor_parallel_size):
        raise ConfigError(f"{FIELD}.draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size "
                          f"({tensor_parallel_size}); got {draft_tp}", field=FIELD)
    if config.uses_draft_model and tensor_parallel_size > 1:
        raise ConfigError(f"{FIELD}: method {config.method} runs its model on the worker of a target with "
                          f"tensor_parallel_size 1 only; this engine has {tensor_parallel_size} (not built yet: a "
                          "draft or head beside a sharded target); use method ngram, or tensor_parallel_size=1",
                          field=FIELD)
    k = config.num_speculative_tokens
    if k + 1 > max_num_batched_tokens:
        raise ConfigError(f"{FIELD}.num_speculative_tokens={k}: a step verifies k + 1 = {k + 1} tokens of a "
                          f"request, more than max_num_batched_tokens ({max_num_batched_tokens})", field=FIELD)
    if k >= max_model_len:
        raise ConfigError(f"{FIELD}.num_speculative_tokens={k} must be below max_model_len ({max_model_len})",
                          field=FIELD)


__all__ = ["DRAFT_MODEL_METHODS", "KNOWN_KEYS", "MAX_SPECULATIVE_TOKENS", "MODEL_METHODS", "NGRAM",
           "SPECULATIVE_CONFIG_DESCRIPTION", "SpeculativeConfig", "check_against_engine",
           "parse_speculative_config"]
