"""InputProcessor without a tokenizer: prompt checks, sampling checks, max_tokens, defaults, n > 1."""

from __future__ import annotations

from typing import Any

import pytest

from asyncengine import EngineConfig, RequestError, SamplingParams
from asyncengine.config.model import ModelConfig
from asyncengine.frontend.processor import InputProcessor
from asyncengine.wire.engine_core import SamplingOptions

MAX_MODEL_LEN = 64
VOCAB = 100
EOS = [2, 7]
GENERATION_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def model_config(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        model_dir="x",
        tokenizer_dir=None,
        served_model_name="m",
        architectures=["LlamaForCausalLM"],
        hf_config={},
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB,
        eos_token_ids=list(EOS),
        generation_defaults={},
    )
    fields.update(changes)
    return ModelConfig(**fields)


def processor(**changes: Any) -> InputProcessor:
    return InputProcessor(EngineConfig(), model_config(**changes), tokenizer=None)


def tokens(n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(i % 90) + 10 for i in range(n)]}


def process_error(prompt: Any, params: Any = None, **changes: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        processor(**changes).process("r", prompt, params)
    return info.value


# --- prompt forms -----------------------------------------------------------------------------------


def test_token_id_prompt():
    out = processor().process("r", {"prompt_token_ids": [1, 5, 9]}, None)
    assert out.request_id == "r"
    assert out.prompt is None
    assert out.prompt_token_ids == [1, 5, 9]
    assert len(out.children) == 1
    child = out.children[0]
    assert child.request_id.endswith(":r")  # unique per submission, ending in the caller's id
    assert child.prompt_token_ids == [1, 5, 9]
    assert isinstance(child.sampling, SamplingOptions)


def test_token_id_prompt_as_tuple_and_with_its_text():
    out = processor().process("r", {"prompt_token_ids": (4, 5), "prompt": "hi"}, None)
    assert out.prompt_token_ids == [4, 5] and isinstance(out.prompt_token_ids, list)
    assert out.prompt == "hi"


@pytest.mark.parametrize("prompt", ["hello", {"prompt": "hello"}, ""])
def test_text_prompt_without_tokenizer_is_refused(prompt):
    error = process_error(prompt)
    assert error.field == "prompt"
    assert "prompt_token_ids" in error.message  # says what to send instead


@pytest.mark.parametrize("prompt", [None, 123, 1.5, [1, 2, 3], (1, 2), {}, {"text": "x"}, b"abc"])
def test_prompt_of_the_wrong_type_is_refused(prompt):
    assert process_error(prompt).field == "prompt"


@pytest.mark.parametrize("token_ids", ["1 2 3", 5, [1, "2"], [1, 2.0], [1, True], [None], {"a": 1}])
def test_prompt_token_ids_of_the_wrong_type_are_refused(token_ids):
    assert process_error({"prompt_token_ids": token_ids}).field == "prompt_token_ids"


def test_empty_prompt_is_refused():
    error = process_error({"prompt_token_ids": []})
    assert error.field == "prompt"
    assert "empty" in error.message


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 6])
def test_prompt_too_long_names_both_lengths(length):
    error = process_error(tokens(length))
    assert error.field == "prompt"
    assert str(length) in error.message and str(MAX_MODEL_LEN) in error.message
    assert "max_model_len" in error.message


def test_prompt_one_short_of_max_model_len_leaves_room_for_one_token():
    out = processor().process("r", tokens(MAX_MODEL_LEN - 1), SamplingParams(max_tokens=None))
    assert out.children[0].sampling.max_tokens == 1


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 50, -1])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(bad):
    error = process_error({"prompt_token_ids": [1, bad, 3]})
    assert error.field == "prompt_token_ids"
    assert str(bad) in error.message and str(VOCAB - 1) in error.message


def test_last_vocabulary_id_is_accepted():
    assert processor().process("r", {"prompt_token_ids": [0, VOCAB - 1]}, None).prompt_token_ids == [0, VOCAB - 1]


def test_sampling_params_of_the_wrong_type_are_refused():
    error = process_error(tokens(3), {"temperature": 0.0})
    assert error.field == "sampling_params"


# --- sampling checks --------------------------------------------------------------------------------


def test_logprobs_above_max_logprobs_are_refused():
    limit = EngineConfig().max_logprobs
    error = process_error(tokens(3), SamplingParams(logprobs=limit + 1))
    assert error.field == "logprobs"
    assert str(limit) in error.message
    out = processor().process("r", tokens(3), SamplingParams(logprobs=limit))
    assert out.children[0].sampling.logprobs == limit


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    error = process_error(tokens(3), SamplingParams(stop_token_ids=[5, VOCAB]))
    assert error.field == "stop_token_ids"
    out = processor().process("r", tokens(3), SamplingParams(stop_token_ids=[5, VOCAB - 1]))
    assert out.children[0].sampling.stop_token_ids == (5, VOCAB - 1)


def test_stop_strings_without_tokenizer_are_refused():
    assert process_error(tokens(3), SamplingParams(stop="\n")).field == "stop"


# --- max_tokens, min_tokens, eos --------------------------------------------------------------------


def test_max_tokens_none_means_the_room_left():
    out = processor().process("r", tokens(10), SamplingParams(max_tokens=None))
    assert out.children[0].sampling.max_tokens == MAX_MODEL_LEN - 10


def test_an_explicit_max_tokens_past_the_context_is_refused_naming_max_tokens():
    # The context-length rule (docs/sampling.md), as vLLM's server has it: one rule for the Python API and HTTP.
    error = process_error(tokens(10), SamplingParams(max_tokens=1000))
    assert error.field == "max_tokens"
    assert "64" in error.message and "10" in error.message and "1000" in error.message
    out = processor().process("r", tokens(10), SamplingParams(max_tokens=MAX_MODEL_LEN - 10))
    assert out.children[0].sampling.max_tokens == MAX_MODEL_LEN - 10
    out = processor().process("r", tokens(10), SamplingParams(max_tokens=5))
    assert out.children[0].sampling.max_tokens == 5


def test_the_default_max_tokens_is_capped_at_the_room_left():
    # vLLM's default 16, which the caller did not set, is capped rather than refused.
    out = processor().process("r", tokens(60), SamplingParams(temperature=0))
    assert out.children[0].sampling.max_tokens == MAX_MODEL_LEN - 60


def test_unset_max_tokens_is_vllms_16():
    assert processor().process("r", tokens(10), None).children[0].sampling.max_tokens == 16


def test_min_tokens_that_the_context_cannot_hold_is_refused_naming_min_tokens():
    # min_tokens is never cut silently: a completion that cannot reach it is a RequestError.
    error = process_error(tokens(60), SamplingParams(min_tokens=10, max_tokens=None))
    assert error.field == "min_tokens" and "room for 4" in error.message
    error = process_error(tokens(60), SamplingParams(min_tokens=10))  # the default max_tokens, capped to 4
    assert error.field == "min_tokens"
    out = processor().process("r", tokens(60), SamplingParams(min_tokens=4, max_tokens=None))
    sampling = out.children[0].sampling
    assert (sampling.max_tokens, sampling.min_tokens) == (4, 4)


def test_eos_ids_are_sent_unless_ignore_eos():
    assert processor().process("r", tokens(3), None).children[0].sampling.eos_token_ids == tuple(EOS)
    out = processor().process("r", tokens(3), SamplingParams(ignore_eos=True))
    assert out.children[0].sampling.eos_token_ids == ()


def test_every_sampling_field_reaches_the_engine_options():
    params = SamplingParams(temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, seed=11, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2, max_tokens=9, min_tokens=2,
                            stop_token_ids=[3], logprobs=4)
    sampling = processor().process("r", tokens(3), params).children[0].sampling
    assert sampling == SamplingOptions(temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, seed=11,
                                       presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                       max_tokens=9, min_tokens=2, stop_token_ids=(3,), eos_token_ids=tuple(EOS),
                                       logprobs=4)


def test_top_k_minus_one_reaches_the_engine_as_zero():
    assert processor().process("r", tokens(3), SamplingParams(top_k=-1)).children[0].sampling.top_k == 0


# --- generation defaults ----------------------------------------------------------------------------


def test_generation_defaults_fill_unset_fields():
    p = processor(generation_defaults=GENERATION_DEFAULTS)
    out = p.process("r", tokens(3), None)
    sampling = out.children[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert out.params.temperature == 0.6  # the returned params carry the defaults too
    assert p.default_sampling_params().temperature == 0.6


def test_explicit_values_beat_generation_defaults():
    p = processor(generation_defaults=GENERATION_DEFAULTS)
    # temperature=1.0 equals vLLM's default but is explicit: it must win over the model's 0.6.
    sampling = p.process("r", tokens(3), SamplingParams(temperature=1.0, top_k=-1)).children[0].sampling
    assert sampling.temperature == 1.0 and sampling.top_k == 0
    assert (sampling.top_p, sampling.repetition_penalty) == (0.9, 1.1)
    greedy = p.process("r", tokens(3), SamplingParams(temperature=0.0)).children[0].sampling
    assert greedy.is_greedy


def test_generation_default_max_tokens_is_still_capped_at_the_room_left():
    p = processor(generation_defaults={"max_tokens": 512})
    assert p.process("r", tokens(10), None).children[0].sampling.max_tokens == MAX_MODEL_LEN - 10
    p = processor(generation_defaults={"max_tokens": 20})
    assert p.process("r", tokens(10), None).children[0].sampling.max_tokens == 20


def test_invalid_generation_default_is_a_request_error_naming_the_field():
    error = process_error(tokens(3), None, generation_defaults={"top_p": 0.0})
    assert error.field == "top_p"
    assert "generation_config" in error.message


def test_params_are_not_modified_by_processing():
    params = SamplingParams(max_tokens=50, seed=1)
    processor(generation_defaults=GENERATION_DEFAULTS).process("r", tokens(10), params)
    assert params.max_tokens == 50 and params.temperature == 1.0 and params.explicit_fields == {"max_tokens", "seed"}


# --- n > 1 ------------------------------------------------------------------------------------------


def test_n_fans_out_into_children_with_distinct_ids_and_consecutive_seeds():
    out = processor().process("req", tokens(5), SamplingParams(n=3, seed=42, temperature=0.8))
    assert len(out.children) == 3
    ids = [child.request_id for child in out.children]
    assert len(set(ids)) == 3 and all(i != "req" for i in ids)
    assert [child.sampling.seed for child in out.children] == [42, 43, 44]
    for child in out.children:
        assert child.prompt_token_ids == out.prompt_token_ids
        assert child.sampling.temperature == 0.8
        assert child.arrival_time == out.children[0].arrival_time


def test_n_without_seed_leaves_children_unseeded():
    out = processor().process("req", tokens(5), SamplingParams(n=3))
    assert [child.sampling.seed for child in out.children] == [None, None, None]
    assert len({child.request_id for child in out.children}) == 3


def test_n_one_keeps_the_seed_and_engine_core_ids_are_unique_per_submission():
    proc = processor()
    first = proc.process("req", tokens(5), SamplingParams(seed=42))
    second = proc.process("req", tokens(5), SamplingParams(seed=42))
    assert [c.sampling.seed for c in first.children] == [42]
    assert first.children[0].request_id != second.children[0].request_id
