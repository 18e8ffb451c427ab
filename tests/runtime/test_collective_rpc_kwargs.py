"""`collective_rpc(method, timeout=None, args=(), kwargs=None)` passes keyword arguments to every worker, as
vLLM's does: through a worker extension whose method echoes what it was given, on the uni executor (the
worker on a thread of this process), on two tensor-parallel worker processes (mp: each rank gets them in a
WorkerCall), and from an engine-core process (the frontend's UtilityCall carries them). The reference is
the extension's own method called here with the same arguments as msgpack delivers them (a tuple as a
list). A value msgspec cannot encode is a TypeError naming the argument, before anything is sent, and the
engine keeps serving.
"""

from __future__ import annotations

import itertools
import os
import sys

import msgspec
import pytest

from asyncengine import SamplingParams
from asyncengine.errors import WorkerError

EXTENSION_MODULE = '''
import os


class EchoExtension:
    def __init__(self, worker):
        self._worker = worker

    def echo(self, *args, **kwargs):
        return {"rank": self._worker.rank, "pid": os.getpid(), "args": list(args), "kwargs": kwargs}

    def scaled(self, value, *, scale=1, offset=0):
        return value * scale + offset
'''

OPTIONS = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**20)
ARGS = (1, "two", (3, 4))
# `method` and `timeout` are collective_rpc's own parameter names: as keyword arguments they are the method's.
KWARGS = {"scale": 0.5, "tags": ["a", "b"], "nested": {"pair": (5, 6), "none": None}, "method": "m", "timeout": 2}
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7]}

_names = itertools.count()


@pytest.fixture
def extension(tmp_path, monkeypatch):
    """A fresh module with EchoExtension, importable here and in the worker processes this test starts."""
    name = f"ae_echo_extension_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(EXTENSION_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    yield f"{name}:EchoExtension"
    sys.modules.pop(name, None)


def reference_echo(extension: str, rank: int) -> dict:
    """What EchoExtension.echo answers on `rank` for ARGS and KWARGS, called here as msgpack delivers them."""
    module, _, cls = extension.partition(":")

    class Worker:
        pass

    worker = Worker()
    worker.rank = rank  # type: ignore[attr-defined]
    delivered = msgspec.msgpack.decode(msgspec.msgpack.encode([list(ARGS), KWARGS]))
    answer = getattr(sys.modules[module], cls)(worker).echo(*delivered[0], **delivered[1])
    answer.pop("pid")
    return msgspec.msgpack.decode(msgspec.msgpack.encode(answer))


def check_echo(llm, extension: str, world_size: int) -> list[int]:
    """Every rank got ARGS and KWARGS; the ranks' pids."""
    answers = llm.collective_rpc("echo", args=ARGS, kwargs=KWARGS)
    assert [answer["rank"] for answer in answers] == list(range(world_size))
    pids = [answer.pop("pid") for answer in answers]
    assert answers == [reference_echo(extension, rank) for rank in range(world_size)]
    # The timeout given by position, the older form (args second), keyword-only parameters:
    assert llm.collective_rpc("echo", 60.0, [7], {"k": 1})[0]["kwargs"] == {"k": 1}
    assert [a["args"] for a in llm.collective_rpc("echo", [8, 9])] == [[8, 9]] * world_size
    assert llm.collective_rpc("echo", [8], {"k": 2})[0]["kwargs"] == {"k": 2}  # (method, args, kwargs)
    assert llm.collective_rpc("scaled", args=[3], kwargs={"scale": 2, "offset": 1}) == [7] * world_size
    assert llm.collective_rpc("scaled", args=[3], kwargs={}) == [3] * world_size
    return pids


def check_refusals_keep_the_engine_serving(llm, world_size: int, reference_tokens: list[int] | None) -> None:
    cases = [
        ({"good": 1, "bad": object()}, (), r"keyword argument 'bad' \(object\) cannot be sent to the workers: "
                                           r"Encoding objects of type object is unsupported; pass msgspec-encodable"),
        ({"huge": 2**70}, (), r"keyword argument 'huge' \(int\) cannot be sent to the workers"),
        (None, (1, 2j), r"positional argument 1 \(complex\) cannot be sent to the workers"),
        ({1: "x"}, (), r"keyword argument name 1 \(int\) is not a string"),
        (["x"], (), r"kwargs is a list; pass the keyword arguments as a dict"),
    ]
    for kwargs, args, message in cases:
        with pytest.raises(TypeError, match=r"^collective_rpc\('echo'\): " + message):
            llm.collective_rpc("echo", args=args, kwargs=kwargs)
    with pytest.raises(TypeError, match=r"with the arguments second, the third is the keyword arguments"):
        llm.collective_rpc("echo", [8], [9])  # the older form (args second) and a list where kwargs go
    # A keyword the worker's method does not take reaches every rank, which says so; the engine goes on.
    with pytest.raises(WorkerError, match=r"describe\(\) got an unexpected keyword argument 'verbose'"):
        llm.collective_rpc("describe", kwargs={"verbose": True})
    (output,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    assert len(tokens) == PARAMS.max_tokens
    if reference_tokens is not None:
        assert tokens == reference_tokens
    assert [a["kwargs"] for a in llm.collective_rpc("echo", kwargs={"after": True})] == [{"after": True}] * world_size


def test_the_uni_executor_passes_kwargs_to_its_worker(extension, tiny_model, make_llm):
    model = str(tiny_model("llama").path)
    reference = list(make_llm(model, **OPTIONS).generate([PROMPT], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
    llm = make_llm(model, worker_extension_cls=extension, **OPTIONS)
    (pid,) = check_echo(llm, extension, world_size=1)
    assert pid == os.getpid()  # the worker is a thread of this process
    check_refusals_keep_the_engine_serving(llm, 1, reference)


@pytest.mark.parametrize("where", ["two worker processes", "an engine-core process"])
def test_kwargs_cross_processes_to_every_rank(extension, tiny_model, make_llm, where):
    model = str(tiny_model("llama").path)
    world_size = 2 if where == "two worker processes" else 1
    options = dict(tensor_parallel_size=2) if world_size == 2 else dict(in_process=False)
    llm = make_llm(model, worker_extension_cls=extension, **options, **OPTIONS)
    pids = check_echo(llm, extension, world_size)
    assert len(set(pids)) == world_size and os.getpid() not in pids
    check_refusals_keep_the_engine_serving(llm, world_size, None)
