"""ExampleStatLogger on hand-made stats: what it counts, and the JSON lines log() writes."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

import ae_stat_logger_example
from ae_stat_logger_example import SUMMARY_FILE_ENV, ExampleStatLogger
from asyncengine.plugins_api import StatLoggerBase


def scheduler(running=0):
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=0, kv_cache_usage=0.0)


def step(prompt=0, generated=0, finished=()):
    return SimpleNamespace(num_prompt_tokens=prompt, num_generation_tokens=generated,
                           finished_requests=[SimpleNamespace(finish_reason=reason, num_generation_tokens=n)
                                              for reason, n in finished])


@pytest.fixture(autouse=True)
def a_process_role(monkeypatch):
    # No engine starts in these tests, so the process has no role: give it one.
    monkeypatch.setattr(ae_stat_logger_example, "current_process_role", lambda: "frontend")
    monkeypatch.setattr(ae_stat_logger_example, "_recorded", set())
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)


def test_it_counts_tokens_and_finished_requests():
    stats = ExampleStatLogger()
    assert isinstance(stats, StatLoggerBase)
    stats.record(scheduler(2), step(prompt=7, generated=2))
    stats.record(scheduler(1), step(generated=2, finished=[("length", 3)]))
    stats.record(None, step(generated=1, finished=[("stop", 2)]))
    stats.record(scheduler(0), None)  # a step without iteration stats
    assert stats.summary() == {"steps": 4, "prompt_tokens": 7, "generation_tokens": 5, "finished_requests": 2,
                               "finished_generation_tokens": 5, "finish_reasons": {"length": 1, "stop": 1},
                               "max_running": 2}


def test_log_writes_a_json_line_when_the_counts_changed(tmp_path, monkeypatch):
    summary_file = tmp_path / "summary.jsonl"
    monkeypatch.setenv(SUMMARY_FILE_ENV, str(summary_file))
    stats = ExampleStatLogger(engine_config=None)
    stats.log()
    stats.record(scheduler(1), step(prompt=3, generated=4, finished=[("length", 4)]))
    stats.log()
    stats.log()  # nothing new
    lines = [json.loads(line) for line in summary_file.read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0]["generation_tokens"] == 0 and lines[0]["what"] == "stat logger summary"
    assert lines[1]["generation_tokens"] == 4 and lines[1]["finished_requests"] == 1
    assert lines[1]["role"] == "frontend" and isinstance(lines[1]["pid"], int)


def test_without_a_file_it_logs_at_info(monkeypatch, caplog):
    monkeypatch.delenv(SUMMARY_FILE_ENV, raising=False)
    stats = ExampleStatLogger()
    stats.record(scheduler(), step(generated=1))
    with caplog.at_level(logging.INFO, logger="ae_stat_logger_example"):
        stats.log()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "ae_stat_logger_example"]
    assert json.loads(message)["generation_tokens"] == 1


def test_records_name_the_process_once(tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(records))
    monkeypatch.delenv(SUMMARY_FILE_ENV, raising=False)
    stats = ExampleStatLogger()
    for _ in range(3):
        stats.record(scheduler(), step())
        stats.log()
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(line["what"], line["role"]) for line in lines] == [("stat logger record", "frontend"),
                                                                ("stat logger log", "frontend")]
