"""The request Structs bound every field at the edge (docs/server.md, "Limits"), in-process: integers
within int64 naming the field, a completion prompt nested at most two lists deep, and the field that
holds a too-deep nesting named without decoding it (on main, msgspec's RecursionError was a 500)."""

from __future__ import annotations

import msgspec
import pytest

from asyncengine.server.errors import from_validation_error
from asyncengine.server.protocol import ChatCompletionRequest, CompletionRequest, too_deep_field

DEEP = b"[" * 10_000 + b"]" * 10_000


def decode_error(body: bytes, struct: type = CompletionRequest):
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(body, type=struct)
    return from_validation_error(info.value)


@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("top_k", 2**64 - 1), ("seed", 2**64),
                                          ("seed", -(2**63) - 1), ("n", 2**63), ("max_tokens", 2**63),
                                          ("min_tokens", 2**70), ("logprobs", 2**63)])
def test_integers_past_int64_are_400s_naming_the_field(field, value):
    error = decode_error(b'{"prompt": "x", "%s": %d}' % (field.encode(), value))
    assert error.status == 400 and error.param == field


def test_chat_integers_and_tools_are_bounded_too():
    chat = b'{"messages": [{"role": "user", "content": "x"}], %s}'
    assert decode_error(chat % b'"top_k": 18446744073709551615', ChatCompletionRequest).param == "top_k"
    assert decode_error(chat % b'"top_logprobs": 9223372036854775808', ChatCompletionRequest).param == "top_logprobs"
    assert decode_error(chat % b'"tools": "notalist"', ChatCompletionRequest).param == "tools"


@pytest.mark.parametrize("prompt", [b'"Hi"', b'["a", "b"]', b"[1, 2]", b"[[1], [2, 3]]", b'[1, "a"]'])
def test_the_prompt_shapes_decode(prompt):
    # (Mixed lists decode here; serving_completions refuses them, naming prompt.)
    assert msgspec.json.decode(b'{"prompt": %s}' % prompt, type=CompletionRequest).prompt is not None


def test_a_prompt_nested_10000_deep_stops_at_the_first_level_too_deep():
    error = decode_error(b'{"prompt": %s}' % DEEP)
    assert error.status == 400 and error.param == "prompt[0][0]"


def test_the_field_holding_a_too_deep_nesting_is_named_without_decoding_it():
    body = b'{"messages": [{"role": "user", "content": "a]]]: [[[ \\" {{"}], "tool_choice" : %s}' % DEEP
    with pytest.raises(RecursionError):
        msgspec.json.decode(body, type=ChatCompletionRequest)
    assert too_deep_field(body) == "tool_choice"
    assert too_deep_field(b'{"a": [[1]], "b": {"c": "[[[["}}') is None
    assert too_deep_field(DEEP) is None  # not an object: no field to name
