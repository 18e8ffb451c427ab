# vLLM's test_scheduler_plugins.py, in its form. Differs: the model is a tiny local one (SHAPED_MODEL;
# vLLM's loads facebook/opt-125m from the hub), sized for a small machine (SHAPED_OPTIONS); a second
# test drives the same engine API to the end of two requests.
import json
import os

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.llm_engine import LLMEngine

MODEL = os.environ["SHAPED_MODEL"]
MACHINE = json.loads(os.environ.get("SHAPED_OPTIONS", "{}"))


class EchoExtension:
    """A worker extension (vLLM's worker_extension_cls, given as a class) answering what it was called with."""

    def __init__(self, worker):
        self.worker = worker

    def echo_args_kwargs(self, *args, **kwargs):
        return {"rank": self.worker.rank, "args": list(args), "kwargs": kwargs}


class DummyV1Scheduler(Scheduler):
    def schedule(self, throttle_prefills: bool = False):
        raise Exception("Exception raised by DummyV1Scheduler")


def test_scheduler_plugins_v1(monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        # Explicitly turn off engine multiprocessing so
        # that the scheduler runs in this process
        m.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        with pytest.raises(Exception) as exception_info:
            engine_args = EngineArgs(
                model=MODEL,
                enforce_eager=True,  # reduce test time
                scheduler_cls=DummyV1Scheduler,
                **MACHINE,
            )

            engine = LLMEngine.from_engine_args(engine_args=engine_args)

            sampling_params = SamplingParams(max_tokens=1)
            engine.add_request("0", "foo", sampling_params)
            engine.step()

        assert str(exception_info.value) == "Exception raised by DummyV1Scheduler"


def test_llm_engine_steps_requests_to_their_end(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = LLMEngine.from_engine_args(EngineArgs(model=MODEL, enforce_eager=True,
                                                   worker_extension_cls=EchoExtension, **MACHINE))
    engine.add_request("text", "foo", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("ids", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True))
    seen, finished = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert len(output.outputs[0].token_ids) >= len(seen.get(output.request_id, ()))  # cumulative
            seen[output.request_id] = list(output.outputs[0].token_ids)
            if output.finished:
                finished[output.request_id] = output
    assert {key: len(output.outputs[0].token_ids) for key, output in finished.items()} == {"text": 3, "ids": 2}
    assert finished["text"].prompt == "foo"
    assert engine.step() == []  # nothing left: no wait
    # vLLM's collective_rpc signature: (method, timeout=None, args=(), kwargs=None)
    (worker,) = engine.collective_rpc("describe", timeout=120.0, args=())
    assert worker["rank"] == 0
    # Positional and keyword arguments reach the worker (here through its extension), as in vLLM.
    answers = engine.collective_rpc("echo_args_kwargs", args=(1, "two"), kwargs={"verbose": True, "n": [3]})
    assert answers == [{"rank": 0, "args": [1, "two"], "kwargs": {"verbose": True, "n": [3]}}]
