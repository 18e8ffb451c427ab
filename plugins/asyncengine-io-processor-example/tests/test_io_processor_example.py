"""ItemsProcessor on its own: the entry point, pre_process's prompts and refusals, post_process's shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio

import ae_io_processor_example
from ae_io_processor_example import DEFAULT_TEMPLATE, MAX_ITEMS, ItemsProcessor, io_processor, parse_data
from asyncengine import CompletionOutput, RequestOutput
from asyncengine.plugins_api import IOProcessor, RequestError


def request(data):
    return SimpleNamespace(data=data)  # pre_process reads only `data` of the IOProcessRequest


def test_the_entry_point_names_an_io_processor_subclass():
    module, _, name = io_processor().partition(":")
    assert module == "ae_io_processor_example"
    assert issubclass(getattr(ae_io_processor_example, name), IOProcessor)


def test_one_prompt_per_item_in_order_from_the_template():
    processor = ItemsProcessor()
    prompts = processor.pre_process(request({"items": ["the sky", "grass {x}"], "template": "Color of {item}:"}))
    assert prompts == ["Color of the sky:", "Color of grass {x}:"]  # braces in an item stay as they are
    assert processor.pre_process(request({"items": ["tea"]})) == [DEFAULT_TEMPLATE.replace("{item}", "tea")]


@pytest.mark.parametrize("data, field", [
    (["a"], "data"),
    ({"items": []}, "data.items"),
    ({"items": ["a", 3]}, "data.items"),
    ({"items": [""]}, "data.items"),
    ({"items": ["a"] * (MAX_ITEMS + 1)}, "data.items"),
    ({"items": ["a"], "template": "no placeholder"}, "data.template"),
    ({"items": ["a"], "extra": 1}, "data.extra"),
])
def test_malformed_data_is_refused_naming_the_field(data, field):
    with pytest.raises(RequestError) as info:
        parse_data(data)
    assert info.value.field == field


def test_post_process_gives_one_result_per_output_in_order():
    outputs = [
        RequestOutput(request_id=f"r-{i}", prompt=prompt, prompt_token_ids=[1, 2], finished=True,
                      outputs=[CompletionOutput(index=0, text=text, token_ids=list(range(count)),
                                                finish_reason=reason)])
        for i, (prompt, text, count, reason) in enumerate([("A", " one", 3, "length"), ("B", " two.", 2, "stop")])
    ]
    result = trio.run(ItemsProcessor().post_process, outputs)
    assert result == {"count": 2, "results": [
        {"prompt": "A", "text": " one", "token_ids": [0, 1, 2], "finish_reason": "length"},
        {"prompt": "B", "text": " two.", "token_ids": [0, 1], "finish_reason": "stop"},
    ]}
    json.dumps(result)  # the server sends it as JSON


def test_each_method_records_where_it_ran_once(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    monkeypatch.setattr(ae_io_processor_example, "_recorded", set())
    monkeypatch.setattr(ae_io_processor_example, "current_process_role", lambda: "frontend")
    processor = ItemsProcessor()
    for _ in range(2):
        processor.pre_process(request({"items": ["x"]}))
        trio.run(processor.post_process, [])
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["what"] for line in lines] == ["io processor pre_process", "io processor post_process"]
    assert {(line["pid"], line["role"]) for line in lines} == {(__import__("os").getpid(), "frontend")}
