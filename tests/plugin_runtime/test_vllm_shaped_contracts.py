"""`asyncengine plugins check` (and every start-up) fails naming the plugin for each contract that would
otherwise fail only at the first request, with vLLM-shaped plugins (tests/plugins/vllm-shaped-first-request,
ported by `plugins port`): a stat logger whose record takes vLLM v0's one argument, an endpoint plugin
with neither attach nor attach_router, two in vLLM's FastAPI form (a subclass of the interface, and vLLM's
own plain class) where fastapi is not installed, a platform whose attention backend is vLLM's descriptor
form naming an implementation without forward, an out-of-tree op with only forward_cuda on a CPU platform."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.vllm_shaped import environment, port_and_install

NO_FASTAPI = ("is vLLM's FastAPI form (attach_router): serving it needs the package 'fastapi', which cannot be "
              "imported here")
CASES = {
    "v0_stats": ({}, "stat logger vllm_shaped_first_request:V0StatLogger (plugin 'v0_stats' "
                     "(asyncengine.stat_logger_plugins from vllm_shaped_first_request 0.1)): record cannot be called "
                     "as the engine calls it, record(scheduler_stats, iteration_stats): too many positional arguments"),
    # vLLM's endpoint form, a subclass of the interface and vLLM's own plain class: served, given fastapi
    "router_only": ({}, "endpoint plugin 'router_only' (vllm_shaped_first_request:RouterOnly (plugin 'router_only' "
                        "(asyncengine.endpoint_plugins from vllm_shaped_first_request 0.1))) " + NO_FASTAPI),
    "fastapi_protocol": ({}, "endpoint plugin 'fastapi_protocol' (vllm_shaped_first_request:ProtocolEndpoint "
                             "(plugin 'fastapi_protocol' (asyncengine.endpoint_plugins from vllm_shaped_first_request "
                             "0.1))) " + NO_FASTAPI),
    "no_routes": ({}, "endpoint plugin 'no_routes' (vllm_shaped_first_request:NoRoutes (plugin 'no_routes' "
                      "(asyncengine.endpoint_plugins from vllm_shaped_first_request 0.1))) defines no attach(app), "
                      "which adds its routes (nor vLLM's attach_router(app))"),
    "descriptor_platform": ({"DESCRIPTOR_PLATFORM": "1"},
                            "attention backend 'vllm_shaped_first_request.DescriptorBackend' "
                            "(vllm_shaped_first_request:DescriptorBackend, a class path, not a registered name, "
                            "chosen by platform descriptor_platform) is vLLM's descriptor form; get_impl_cls() "
                            "returned builtins:object, which defines no forward(query, key, value, kv_cache, "
                            "metadata)"),
    "cuda_only_op": ({}, "out-of-tree custom op vllm_shaped_first_request:register_cuda_only_op.<locals>."
                         "CudaOnlySiluAndMul for 'SiluAndMul' (registered by plugin 'cuda_only_op' "
                         "(vllm_shaped_first_request)) has no forward for platform cpu"),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target, report = port_and_install("vllm-shaped-first-request", tmp_path_factory.mktemp("first-request"))
    assert "0 use(s) cannot be mapped" in report
    return target


@pytest.mark.parametrize("plugin", sorted(CASES))
def test_plugins_check_fails_naming_the_plugin(target, plugin):
    extra_env, expected = CASES[plugin]
    result = subprocess.run([sys.executable, "-m", "asyncengine", "plugins", "check", "--in-process", "--plugins",
                             plugin], capture_output=True, text=True, timeout=180,
                            env=environment(target, **extra_env))
    assert result.returncode == 1, result.stdout + result.stderr
    assert expected in result.stderr, result.stderr[-3000:]
