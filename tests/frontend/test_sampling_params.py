"""SamplingParams: vLLM's names and defaults, validation naming the field, explicit fields, defaults."""

from __future__ import annotations

import copy
import math

import pytest

from asyncengine import RequestError, SamplingParams

VLLM_DEFAULTS = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
}


def test_defaults_are_vllms():
    params = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(params, name) == value, name
    assert params.stop_token_ids == []  # None normalizes to [], as in vLLM
    assert params.explicit_fields == frozenset()
    assert not params.is_greedy


# --- validation -----------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")

INVALID = [
    # (kwargs, field)
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": 1.0}, "n"),
    ({"n": True}, "n"),
    ({"n": "2"}, "n"),
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.0001}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": 5.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"min_p": NAN}, "min_p"),
    ({"min_p": INF}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"presence_penalty": -INF}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": INF}, "frequency_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 10.0}, "max_tokens"),
    ({"max_tokens": INF}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens (16), as in vLLM
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": 5}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ["ok", 2]}, "stop"),
    ({"stop": ["ok", None]}, "stop"),
    ({"stop": {"a"}}, "stop"),
    ({"stop": b"x"}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"ignore_eos": None}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize("kwargs, field", INVALID, ids=[f"{k}" for k, _ in INVALID])
def test_invalid_values_raise_request_error_naming_the_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)  # as vLLM, which raises ValueError
    assert info.value.message and field in info.value.message


VALID_EDGES = [
    {"n": 5},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 100.0},
    {"top_p": 1},
    {"top_p": 1e-9},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0},
    {"min_p": 1.0},
    {"presence_penalty": 2.0},
    {"presence_penalty": -2},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 10},
    {"max_tokens": None},
    {"max_tokens": 1},
    {"min_tokens": 16},
    {"min_tokens": 1000, "max_tokens": None},
    {"min_tokens": 4, "max_tokens": 4},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": 0},
    {"seed": -7},
    {"seed": 2**63 - 1},
    {"seed": -(2**63)},
    {"stop": None},
    {"stop": []},
    {"stop_token_ids": []},
    {"stop_token_ids": None},
    {"ignore_eos": True},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES, ids=[f"{k}" for k in VALID_EDGES])
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert params.explicit_fields == frozenset(kwargs)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


# --- normalization --------------------------------------------------------------------------------


def test_stop_string_becomes_a_one_element_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_stop_token_ids_tuple_becomes_a_list():
    params = SamplingParams(stop_token_ids=(3, 4))
    assert params.stop_token_ids == [3, 4]
    assert isinstance(params.stop_token_ids, list)


def test_stop_list_is_copied():
    stop = ["a"]
    params = SamplingParams(stop=stop)
    stop.append("b")
    assert params.stop == ["a"]


def test_top_k_minus_one_normalizes_to_zero_and_stays_explicit():
    params = SamplingParams(top_k=-1)
    assert params.top_k == 0
    assert params.explicit_fields == {"top_k"}
    assert params == SamplingParams(top_k=0)


@pytest.mark.parametrize("temperature, greedy", [(0, True), (0.0, True), (9e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy_below_1e_minus_5(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


# --- explicit fields and generation defaults ------------------------------------------------------


def test_explicit_fields_are_those_passed_even_when_equal_to_the_default():
    params = SamplingParams(temperature=1.0, max_tokens=16, stop="x", seed=None)
    assert params.explicit_fields == {"temperature", "max_tokens", "stop", "seed"}


def test_with_defaults_fills_only_unset_fields():
    params = SamplingParams(temperature=1.0, max_tokens=5)
    merged = params.with_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100,
                                   "repetition_penalty": 1.1, "min_p": 0.05})
    assert merged.temperature == 1.0  # explicit, though equal to vLLM's default
    assert merged.max_tokens == 5
    assert (merged.top_p, merged.top_k, merged.repetition_penalty, merged.min_p) == (0.9, 20, 1.1, 0.05)
    # The untouched fields keep vLLM's defaults.
    assert merged.n == 1 and merged.presence_penalty == 0.0 and merged.stop == []
    # Still the caller's view of what they set; the original is unchanged.
    assert merged.explicit_fields == {"temperature", "max_tokens"}
    assert (params.top_p, params.top_k) == (1.0, 0)


def test_with_defaults_ignores_unknown_keys_and_accepts_empty():
    params = SamplingParams(seed=3)
    assert params.with_defaults({}) == params
    assert params.with_defaults({"do_sample": True, "bogus": 1}) == params


def test_with_defaults_normalizes_the_defaults():
    assert SamplingParams().with_defaults({"top_k": -1}).top_k == 0


@pytest.mark.parametrize("defaults, field", [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
                                             ({"max_tokens": 0}, "max_tokens")])
def test_with_defaults_rejects_an_invalid_default_naming_generation_config(defaults, field):
    with pytest.raises(RequestError) as info:
        SamplingParams().with_defaults(defaults)
    assert info.value.field == field
    assert "generation_config" in info.value.message


def test_with_defaults_keeps_an_explicit_none_max_tokens():
    # Explicit max_tokens=None (room left) is kept even if the model has a default.
    assert SamplingParams(max_tokens=None).with_defaults({"max_tokens": 32}).max_tokens is None


# --- assignment -----------------------------------------------------------------------------------


def test_assignment_is_validated_and_leaves_the_object_unchanged_on_error():
    params = SamplingParams(temperature=0.5)
    with pytest.raises(RequestError) as info:
        params.temperature = -1.0
    assert info.value.field == "temperature"
    assert params.temperature == 0.5
    with pytest.raises(RequestError) as info:
        params.top_p = math.nan
    assert info.value.field == "top_p"
    with pytest.raises(RequestError) as info:
        params.min_tokens = 100  # above max_tokens (16)
    assert info.value.field == "min_tokens"
    assert params.min_tokens == 0 and params.explicit_fields == {"temperature"}


def test_assignment_normalizes_and_marks_the_field_explicit():
    params = SamplingParams()
    params.stop = "end"
    params.top_k = -1
    params.max_tokens = 3
    assert params.stop == ["end"] and params.top_k == 0 and params.max_tokens == 3
    assert params.explicit_fields == {"stop", "top_k", "max_tokens"}


def test_assignment_to_an_unknown_attribute_fails():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.best_of = 2  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        params._explicit = frozenset({"n"})


def test_clone_validates_and_adds_the_changed_fields():
    params = SamplingParams(seed=1)
    clone = params.clone(n=2)
    assert (clone.n, clone.seed) == (2, 1) and clone.explicit_fields == {"n", "seed"}
    assert params.n == 1
    with pytest.raises(RequestError) as info:
        params.clone(n=0)
    assert info.value.field == "n"


def test_equality_compares_values():
    assert SamplingParams(temperature=0.5, stop="x") == SamplingParams(stop=["x"], temperature=0.5)
    assert SamplingParams(temperature=0.5) != SamplingParams(temperature=0.6)
    assert "temperature=0.5" in repr(SamplingParams(temperature=0.5))


# --- copies and assignment ---------------------------------------------------------------------


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copy_and_deepcopy_round_trip(copier):
    params = SamplingParams(temperature=0.5, stop="x", seed=3)
    copied = copier(params)
    assert copied == params and copied.explicit_fields == params.explicit_fields


def test_assignment_after_with_defaults_keeps_the_filled_in_defaults():
    # vLLM's usual pattern: params = llm.get_default_sampling_params(); params.max_tokens = 64
    params = SamplingParams().with_defaults({"temperature": 0.6, "top_k": 20})
    params.max_tokens = 64
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 64)


def test_pickle_round_trip_keeps_what_the_caller_set():
    import pickle

    params = SamplingParams(temperature=0.5, stop="x")
    copied = pickle.loads(pickle.dumps(params))
    assert copied == params and copied.explicit_fields == {"temperature", "stop"}


def test_a_struct_decoded_by_msgspec_is_checked_and_counts_the_fields_off_their_defaults():
    import msgspec

    decoded = msgspec.json.decode(b'{"temperature": 0.2, "stop": ["y"], "n": 1}', type=SamplingParams)
    assert decoded.stop == ["y"] and decoded.explicit_fields == {"temperature", "stop"}
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.json.decode(b'{"temperature": -1}', type=SamplingParams)
    # A rule of SamplingParams' own, besides the table's types (a decoder says it as a ValidationError).
    with pytest.raises(msgspec.ValidationError, match=r"min_tokens \(20\) must not exceed max_tokens \(4\)"):
        msgspec.json.decode(b'{"min_tokens": 20, "max_tokens": 4}', type=SamplingParams)
