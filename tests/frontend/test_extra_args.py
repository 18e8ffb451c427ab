"""SamplingParams.extra_args and the logits processors' validate_params in the frontend.

extra_args must encode as msgpack (it travels to the workers) and is kept as the workers will see
it; every loaded processor class validates each request: its RequestError is the answer as is, any
other exception refuses only that request, naming the class.
"""

from __future__ import annotations

import logging
from datetime import date

import msgspec
import pytest

from asyncengine import EngineConfig, RequestError, SamplingParams
from asyncengine.config.model import ModelConfig
from asyncengine.frontend.processor import InputProcessor
from asyncengine.plugins_api import LogitsProcessor
from asyncengine.wire.engine_core import SamplingOptions

PROMPT = {"prompt_token_ids": [5, 6, 7]}


def model_config() -> ModelConfig:
    return ModelConfig(model_dir="x", tokenizer_dir=None, served_model_name="m", architectures=["LlamaForCausalLM"],
                       hf_config={}, dtype="float32", max_model_len=64, vocab_size=100, eos_token_ids=[2],
                       generation_defaults={})


# --- extra_args -----------------------------------------------------------------------------------


def test_extra_args_default_to_none_and_reach_the_engine_core_request():
    assert SamplingParams().extra_args is None
    extra = {"banned": [1, 2], "nested": {"a": [True, None, 1.5, "x"]}}
    (child,) = InputProcessor(EngineConfig(), model_config(), None).process(
        "r", PROMPT, SamplingParams(extra_args=extra)).children
    assert child.sampling.extra_args == extra


def test_extra_args_survive_the_wire():
    options = SamplingOptions(extra_args={"ids": [1, 2], "flag": True})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(options), type=SamplingOptions)
    assert decoded == options


def test_extra_args_are_kept_as_the_worker_will_see_them():
    params = SamplingParams(extra_args={"ids": (1, 2), "day": date(2026, 1, 2)})
    assert params.extra_args == {"ids": [1, 2], "day": "2026-01-02"}


def test_extra_args_are_copied_with_the_rest():
    params = SamplingParams(extra_args={"a": 1})
    assert params.clone(temperature=0.5).extra_args == {"a": 1}
    assert params.with_defaults({"temperature": 0.2}).extra_args == {"a": 1}
    assert "extra_args" in params.explicit_fields


@pytest.mark.parametrize("extra_args", [[1, 2], "x", {1: "int key"}])
def test_extra_args_must_be_a_dict_with_string_keys(extra_args):
    with pytest.raises(RequestError, match="dict with string keys") as info:
        SamplingParams(extra_args=extra_args)
    assert info.value.field == "extra_args"


@pytest.mark.parametrize("value", [object(), 1j, 2**70, [b"ok", object()]])
def test_values_that_do_not_encode_are_refused(value):
    with pytest.raises(RequestError, match="msgpack-encodable") as info:
        SamplingParams(extra_args={"value": value})
    assert info.value.field == "extra_args"


def test_assignment_is_checked_too():
    params = SamplingParams()
    with pytest.raises(RequestError) as info:
        params.extra_args = {"value": object()}
    assert info.value.field == "extra_args"


# --- validate_params ------------------------------------------------------------------------------


class NeedsLimit(LogitsProcessor):
    @classmethod
    def validate_params(cls, params):
        limit = (params.extra_args or {}).get("limit", 0)
        if not isinstance(limit, int):
            raise RequestError("limit must be an integer", field="extra_args.limit")
        if limit < 0:
            raise ValueError("limit must not be negative")  # vLLM's way of saying "bad arguments"


class Buggy(LogitsProcessor):
    @classmethod
    def validate_params(cls, params):
        return params.extra_args["missing"]  # a KeyError for every request without it


def process(params, *classes):
    return InputProcessor(EngineConfig(), model_config(), None, classes).process("r", PROMPT, params)


def test_valid_requests_pass_every_processor():
    assert process(SamplingParams(extra_args={"limit": 3}), NeedsLimit).children


def test_a_request_error_from_a_processor_is_the_answer_as_is():
    with pytest.raises(RequestError) as info:
        process(SamplingParams(extra_args={"limit": "many"}), NeedsLimit)
    assert info.value.field == "extra_args.limit" and info.value.message == "limit must be an integer"


def test_a_value_error_refuses_the_request_naming_the_class(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(RequestError) as info:
        process(SamplingParams(extra_args={"limit": -1}), NeedsLimit)
    assert info.value.field == "extra_args"
    assert str(info.value) == ("logits processor test_extra_args:NeedsLimit rejected the request: "
                               "ValueError: limit must not be negative")
    assert not caplog.records  # the plugin said "bad arguments": nothing to investigate


def test_a_plugin_bug_refuses_only_that_request_and_is_logged(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(RequestError, match="Buggy rejected the request: TypeError"):
        process(SamplingParams(), Buggy)  # extra_args is None: None["missing"] is a TypeError
    with caplog.at_level(logging.WARNING), pytest.raises(RequestError, match="Buggy rejected the request: KeyError"):
        process(SamplingParams(extra_args={}), Buggy)
    assert [record.exc_info[0] for record in caplog.records] == [TypeError, KeyError]  # with their tracebacks
    assert process(SamplingParams(extra_args={"missing": 1}), Buggy).children  # and the next request is served
