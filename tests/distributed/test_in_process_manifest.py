"""An engine core in the frontend's process still hands the frontend's manifest to its worker processes.

With `in_process=True` and worker processes (mp, or Ray), the workers are other interpreters: each must
compare its registries with the frontend's, as it does under an engine-core process. Here a key exists
only in this process's model registry (as if a plugin were installed in the frontend's environment and
not in the workers'): start-up, and `asyncengine plugins check`, fail in the worker's manifest check,
naming the key. (The registration is undone after each test: monkeypatch owns it.)
"""

from __future__ import annotations

import re

import anyio
import pytest

from asyncengine.errors import MissingRegistration

KEY = "FrontendOnlyLlamaForCausalLM"
MESSAGE = (rf"the worker rank 0 \(pid \d+\) failed in start-up phase 'manifest check': model architecture "
           rf"'{KEY}' is missing from registry 'models' here, while the frontend \(pid \d+\) has it")


@pytest.fixture
def key_only_in_this_process(monkeypatch):
    from asyncengine.interfaces.registry import Entry
    from asyncengine.plugins_api import ModelRegistry

    # Not used by the model served: only the manifest check can notice that the workers lack it.
    monkeypatch.setitem(ModelRegistry._entries, KEY, Entry("asyncengine.models.llama:LlamaForCausalLM", "the test"))


def test_in_process_engine_core_workers_check_the_frontend_manifest(key_only_in_this_process, tiny_model):
    from asyncengine import LLM

    with pytest.raises(MissingRegistration, match=MESSAGE):
        LLM(str(tiny_model("llama").path), in_process=True, distributed_executor_backend="mp",
            skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=2**20).close()


def test_in_process_plugins_check_workers_check_the_frontend_manifest(key_only_in_this_process):
    from asyncengine import EngineConfig
    from asyncengine.cli.reports.check import check_start

    config = EngineConfig(in_process=True, distributed_executor_backend="mp")
    _, error = anyio.run(check_start, config, backend="trio")
    assert isinstance(error, MissingRegistration), error
    assert re.search(MESSAGE, str(error)), error
