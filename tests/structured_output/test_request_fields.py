"""StructuredOutputsParams and the HTTP fields that build it: what is accepted, and the field each refusal names."""

from __future__ import annotations

import pytest

from asyncengine import RequestError, SamplingParams, StructuredOutputsParams
from asyncengine.structured_output.openai_fields import from_request
from asyncengine.config.structured_outputs import configured_backend_name
from asyncengine.errors import ConfigError


def test_a_schema_as_a_dict_or_as_text_is_the_same_constraint():
    as_dict = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}).to_spec()
    as_text = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}').to_spec()
    assert as_dict == as_text and as_dict.cache_key("xgrammar") == as_text.cache_key("xgrammar")
    assert as_dict.cache_key("xgrammar") != as_dict.cache_key("guidance")


@pytest.mark.parametrize("params, field", [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 1]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object=True, backend=""), "structured_outputs.backend"),
])
def test_a_malformed_constraint_names_its_field(params, field):
    with pytest.raises(RequestError) as caught:
        SamplingParams(structured_outputs=StructuredOutputsParams(**params))
    assert caught.value.field == field


def test_sampling_params_takes_the_fields_as_a_dict_too():
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["x", "y"])
    with pytest.raises(RequestError, match="structured_outputs"):
        SamplingParams(structured_outputs="x")


def test_response_format_types():
    assert from_request({"type": "text"}, None) is None
    assert from_request({"type": "json_object"}, None) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    made = from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}, None)
    assert made == StructuredOutputsParams(json=schema)
    assert from_request(None, {"regex": "[0-9]+"}) == StructuredOutputsParams(regex="[0-9]+")


@pytest.mark.parametrize("response_format, structured_outputs, field", [
    ({"type": "xml"}, None, "response_format"),
    ({"type": "json_schema"}, None, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None, "response_format.json_schema.schema"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
    (None, {"regexp": "a"}, "structured_outputs"),
    (None, {"regex": 5}, "structured_outputs.regex"),
])
def test_bad_http_fields_name_theirs(response_format, structured_outputs, field):
    with pytest.raises(RequestError) as caught:
        from_request(response_format, structured_outputs)
    assert caught.value.field == field


def test_the_configured_backend():
    assert configured_backend_name(None) == "xgrammar"
    assert configured_backend_name({"backend": "auto"}) == "xgrammar"
    assert configured_backend_name({"backend": "guidance"}) == "guidance"
    with pytest.raises(ConfigError, match="unknown keys"):
        configured_backend_name({"backend": "guidance", "disable_fallback": True})
