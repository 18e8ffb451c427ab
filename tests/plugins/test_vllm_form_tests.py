"""vLLM's plugin tests, in their own form (tests/plugins/vllm-form-tests, our code written as vLLM's
tests/plugins_tests are), ported by `asyncengine plugins port` alone and run with pytest, unchanged
after the port:
- the scheduler test drives vLLM's `EngineArgs` and `LLMEngine.from_engine_args / add_request / step`
  with a scheduler class passed as an object whose `schedule()` raises, and matches the error's text
  exactly (the plugin's own exception, from an engine core in this process); a second test steps two
  requests to their end and calls `collective_rpc` with vLLM's signature;
- the stat-logger and endpoint-plugin tests stub `vllm.v1.metrics.loggers.load_plugins_by_group` and
  `vllm.plugins.load_plugins_by_group` as vLLM's do (the tool rewrites the strings to the function our
  loaders look up when called);
- the platform test runs with tests/plugins/vllm-shaped-privateuse (vLLM's test platform's shape:
  `device_type = "privateuseone"`, which torch has no backend for here) installed: starting an engine
  fails where the model would be placed, naming the device, and `current_platform.device_name`
  answers after it; vLLM's older selector `get_attn_backend(...)` gives the platform's
  `PlaceholderAttentionBackend` subclass.
Two pytest processes: the platform plugin is always active, as vLLM's is, so it gets one of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from support.tiny_tokenizer import save_tiny_tokenizer
from support.vllm_shaped import PLUGINS, environment, port, port_and_install

MACHINE = {"max_model_len": 256, "kv_cache_memory_bytes": 4 * 2**20}

ENGINE_TESTS = {
    "scheduler_plugins": ["test_scheduler_plugins_v1", "test_llm_engine_steps_requests_to_their_end"],
    "stats_logger_plugins": ["test_no_plugins_loaded_if_env_empty", "test_invalid_stat_logger_plugin_raises"],
    "endpoint_plugins": ["test_dummy_plugin_satisfies_protocol", "test_no_plugins_loaded_when_allowlist_unset",
                         "test_no_plugins_loaded_when_allowlist_is_empty_string",
                         "test_plugin_skipped_when_required_tasks_miss",
                         "test_plugin_loaded_when_required_tasks_is_none",
                         "test_plugin_skipped_when_required_tasks_set_but_supported_tasks_none"],
}
PLATFORM_TESTS = {"platform_plugins": ["test_platform_plugins", "test_oot_attention_backend"]}


def _run_pytest(folder, modules, env, junit):
    # A pytest of its own, outside this repository's configuration (an empty ini in the folder).
    (folder / "pytest.ini").write_text("[pytest]\n")
    files = [str(folder / f"test_{module}.py") for module in modules]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(folder / "pytest.ini"), f"--junitxml={junit}", *files], cwd=folder,
                          capture_output=True, text=True, timeout=600, env=env)


def _outcomes(junit):
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        key = (case.get("classname", "").rpartition(".")[2].removeprefix("test_"), case.get("name"))
        outcomes[key] = "passed" if failure is None else f"failed: {failure.get('message')}\n{failure.text}"
    return outcomes


@pytest.fixture(scope="module")
def ported(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("vllm-form")
    tests = root / "tests"
    shutil.copytree(PLUGINS / "vllm-form-tests", tests)
    result = port(tests, write=True)
    assert result.returncode == 0 and "0 use(s) cannot be mapped" in result.stdout, result.stdout + result.stderr
    for module in [*ENGINE_TESTS, *PLATFORM_TESTS]:  # named test_*.py once ported, for pytest to collect
        (tests / f"{module}.py").rename(tests / f"test_{module}.py")
    model = root / "model"  # the tiny Llama with a tokenizer: vLLM's scheduler test sends a text prompt
    shutil.copytree(tiny_model("llama").path, model)
    save_tiny_tokenizer(model)
    platform, report = port_and_install("vllm-shaped-privateuse", root)
    return tests, model, platform, report, result.stdout


@pytest.fixture(scope="module")
def outcomes(ported):
    tests, model, platform, _, _ = ported
    options = {"SHAPED_MODEL": str(model), "SHAPED_OPTIONS": json.dumps(MACHINE)}
    found = {}
    for modules, targets, name in ((ENGINE_TESTS, (), "engine"), (PLATFORM_TESTS, (platform,), "platform")):
        junit = tests / f"{name}.xml"
        result = _run_pytest(tests, modules, environment(*targets, **options), junit)
        assert junit.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
        found.update(_outcomes(junit))
    return found


def test_the_port_tool_maps_every_use(ported):
    _, _, _, platform_report, tests_report = ported
    assert '"vllm.v1.metrics.loggers.load_plugins_by_group"  ->  ' \
           '"asyncengine.compat.plugins.load_plugins_by_group"' in tests_report
    assert "from vllm.v1.engine.llm_engine import LLMEngine  ->  from asyncengine.compat.llm_engine import " \
           "LLMEngine" in tests_report
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in tests_report  # read under vLLM's name: left, and not listed
    assert "from asyncengine.compat.attention_selector import PlaceholderAttentionBackend" in platform_report
    assert "0 use(s) cannot be mapped" in platform_report


@pytest.mark.extension_point("E4", "E5", "C1", "P", "R3")
@pytest.mark.parametrize("module, test", [(module, test) for group in (ENGINE_TESTS, PLATFORM_TESTS)
                                          for module, tests in group.items() for test in tests])
def test_the_ported_vllm_test_passes(outcomes, module, test):
    assert outcomes.get((module, test)) == "passed", outcomes.get((module, test), f"not run; ran: {sorted(outcomes)}")
