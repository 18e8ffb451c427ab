"""`asyncengine plugins check` (and every start-up) fails naming the plugin for each contract that would
otherwise fail only at the first request, with vLLM-shaped plugins (tests/plugins/vllm-shaped-first-request,
ported by `plugins port`): a stat logger whose record takes vLLM v0's one argument, an endpoint plugin
with vLLM's attach_router and no attach (and one in vLLM's own form, a plain class), a platform whose attention backend is vLLM's descriptor form
(no forward), an out-of-tree op with only forward_cuda on a CPU platform."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

CASES = {
    "v0_stats": ({}, "stat logger vllm_shaped_first_request:V0StatLogger (plugin 'v0_stats' "
                     "(asyncengine.stat_logger_plugins from vllm_shaped_first_request 0.1)): record cannot be called "
                     "as the engine calls it, record(scheduler_stats, iteration_stats): too many positional arguments"),
    "router_only": ({}, "endpoint plugin 'router_only' (vllm_shaped_first_request:RouterOnly) defines no attach(app), "
                        "which adds its routes (it has attach_router: vLLM's FastAPI form"),
    "descriptor_platform": ({"DESCRIPTOR_PLATFORM": "1"},
                            "attention backend 'vllm_shaped_first_request.DescriptorBackend' "
                            "(vllm_shaped_first_request:DescriptorBackend, chosen by platform descriptor_platform) "
                            "defines no forward(query, key, value, kv_cache, metadata)"),
    "fastapi_protocol": ({}, "plugin 'fastapi_protocol' (asyncengine.endpoint_plugins from vllm_shaped_first_request "
                             "0.1) returned <vllm_shaped_first_request.ProtocolEndpoint object"),
    "cuda_only_op": ({}, "out-of-tree custom op vllm_shaped_first_request:register_cuda_only_op.<locals>."
                         "CudaOnlySiluAndMul for 'SiluAndMul' (registered by plugin 'cuda_only_op' "
                         "(vllm_shaped_first_request)) has no forward for platform cpu"),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target, report = port_and_install("vllm-shaped-first-request", tmp_path_factory.mktemp("first-request"),
                                      unmapped_ok=True)
    assert "cannot map attach_router" in report
    return target


@pytest.mark.parametrize("plugin", sorted(CASES))
def test_plugins_check_fails_naming_the_plugin(target, plugin):
    extra_env, expected = CASES[plugin]
    if plugin == "fastapi_protocol":  # vLLM's own shape: refused when loaded, saying what to write instead
        expected_too = "it has attach_router: vLLM's FastAPI form, which is not served here"
    result = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "check", "--in-process", "--plugins",
                             plugin], capture_output=True, text=True, timeout=180,
                            env=environment(target, **extra_env))
    assert result.returncode == 1, result.stdout + result.stderr
    assert expected in result.stderr, result.stderr[-3000:]
    if plugin == "fastapi_protocol":
        assert expected_too in result.stderr, result.stderr[-3000:]
