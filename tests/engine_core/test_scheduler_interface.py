"""SchedulerInterface (issue 31, acceptance 3): a `scheduler_cls` that implements it without subclassing
anything runs W3-shaped requests (W3's draw, scaled to a tiny random-weight Llama: greedy, ignore_eos, a KV
cache small enough to preempt) token for token as the built-in scheduler does, async scheduling on; one that
lacks methods fails start-up naming them and the class; the built-in Scheduler implements every method."""

from __future__ import annotations

import logging
from random import randint, seed

import pytest

from asyncengine import LLM, SamplingParams, StartupError
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.interfaces.scheduler import SCHEDULER_METHODS, SchedulerInterface, missing_scheduler_methods

CALLS: dict[str, int] = {}


class DelegatingScheduler:
    """SchedulerInterface's methods, each handing over to a built-in Scheduler it owns: no base class."""

    def __init__(self, **kwargs):
        self._inner = Scheduler(**kwargs)

    def _call(self, name: str, *args):
        CALLS[name] = CALLS.get(name, 0) + 1
        return getattr(self._inner, name)(*args)

    def add_request(self, request):
        return self._call("add_request", request)

    def schedule(self):
        return self._call("schedule")

    def update_from_output(self, scheduler_output, model_runner_output):
        return self._call("update_from_output", scheduler_output, model_runner_output)

    def finish_requests(self, request_ids, finished_status):
        return self._call("finish_requests", request_ids, finished_status)

    def fail_request(self, request_id, message, field):
        return self._call("fail_request", request_id, message, field)

    def get_grammar_bitmask(self, scheduler_output):
        return self._call("get_grammar_bitmask", scheduler_output)

    def get_num_unfinished_requests(self):
        return self._call("get_num_unfinished_requests")

    def has_unfinished_requests(self):
        return self._call("has_unfinished_requests")

    def has_finished_requests(self):
        return self._call("has_finished_requests")

    def has_requests(self):
        return self._call("has_requests")

    def make_stats(self):
        return self._call("make_stats")

    def reset_prefix_cache(self):
        return self._call("reset_prefix_cache")

    def shutdown(self):
        return self._call("shutdown")


class LacksTheOutputSide(DelegatingScheduler):
    """Everything but the two methods below, which it leaves as plain attributes."""

    update_from_output = None
    has_finished_requests = None


def w3_shaped(vocab_size: int, count: int, max_tokens: int) -> tuple[list[dict], list[SamplingParams]]:
    """W3's draw (bench/throughput.py; seed 0, 32 prompts of 64-512 ids in 0..10000, 32-256 output tokens), its
    first `count` scaled to a tiny model: ids modulo its vocabulary, prompts half as long, outputs cut to
    `max_tokens`; greedy, ignore_eos."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(64, 512))] for _ in range(32)]
    lengths = [randint(32, 256) for _ in range(32)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(n, max_tokens)) for n in lengths]
    return ([{"prompt_token_ids": [t % vocab_size for t in p[: len(p) // 2]]} for p in prompts[:count]],
            params[:count])


OPTIONS = dict(skip_tokenizer_init=True, max_model_len=512, max_num_batched_tokens=512,
               kv_cache_memory_bytes=2**19)  # 512 KiB: about 1,000 tokens, fewer than the requests (may preempt)


def test_a_class_implementing_the_interface_without_subclassing_runs_w3_shaped_requests_as_the_builtin(
        tiny_model, caplog):
    model = tiny_model("llama")
    prompts, params = w3_shaped(model.vocab_size, 8, max_tokens=24)
    with LLM(str(model.path), **OPTIONS) as llm:
        reference = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    CALLS.clear()
    with caplog.at_level(logging.WARNING, logger="asyncengine.engine_core.core"):
        with LLM(str(model.path), scheduler_cls=DelegatingScheduler, **OPTIONS) as llm:
            assert llm.engine.config.async_scheduling
            tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
            stats = llm._portal.call(llm.engine.get_scheduler_stats)  # through make_stats
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    assert tokens == reference
    assert [len(t) for t in tokens] == [p.max_tokens for p in params]
    assert CALLS["add_request"] == 8 and CALLS["schedule"] >= 24 and CALLS["update_from_output"] >= 24
    assert CALLS["make_stats"] >= 1 and CALLS["shutdown"] == 1  # (get_scheduler_stats; the rest inside the inner one)
    assert any("does not subclass Scheduler and async scheduling is on" in r.getMessage() for r in caplog.records)


def test_a_class_lacking_methods_fails_startup_naming_them_and_the_class(tiny_model):
    with pytest.raises(StartupError) as info:
        with LLM(str(tiny_model("llama").path), scheduler_cls=LacksTheOutputSide, **OPTIONS):
            pass
    message = str(info.value)
    assert "scheduler_cls" in message and "LacksTheOutputSide lacks has_finished_requests, update_from_output" in message


def test_the_builtin_scheduler_implements_every_method():
    assert issubclass(Scheduler, SchedulerInterface) and missing_scheduler_methods(Scheduler) == []
    assert missing_scheduler_methods(DelegatingScheduler) == []
    assert {"schedule", "update_from_output", "add_request", "finish_requests", "get_num_unfinished_requests",
            "has_finished_requests", "make_stats", "reset_prefix_cache", "shutdown"} <= set(SCHEDULER_METHODS)

    class HalfDone(SchedulerInterface):  # a subclass of the interface that left abstract methods
        def schedule(self):
            raise NotImplementedError

    assert "add_request" in missing_scheduler_methods(HalfDone) and "schedule" not in missing_scheduler_methods(HalfDone)
