"""A public vLLM plugin from PyPI, vllm-musa 0.1.1 (a platform plugin), ported by the tool alone and its
registration layer run, through bench/port_public_plugins.py (docs/porting.md, public vLLM plugins). The test
never downloads: it runs only where the wheel is cached (AE_PUBLIC_PLUGINS_CACHE, default /tmp/vplug-pypi; fill it
with `python bench/port_public_plugins.py --download vllm-musa`), and skips saying so elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "port_public_plugins.py"
spec = importlib.util.spec_from_file_location("port_public_plugins", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

NAME, VERSION = "vllm-musa", "0.1.1"
pytestmark = pytest.mark.skipif(bench.wheel_path(bench.DEFAULT_CACHE, NAME, VERSION) is None,
                                reason=f"the {NAME} {VERSION} wheel is not cached in {bench.DEFAULT_CACHE} (tests never "
                                       f"download: python bench/port_public_plugins.py --download {NAME})")

# the hooks asyncengine never calls, and the attention backend's path (docs/porting.md)
REMAINING = {"vllm.attention.backends.registry.AttentionBackendEnum", "vllm.lora.punica_wrapper.punica_gpu."
             "PunicaWrapperGPU", "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
             "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator",
             "vllm.compilation.cuda_graph.CUDAGraphWrapper"}


def test_the_registration_layer_runs_with_the_rewrite_alone(tmp_path):
    figures = bench.survey(NAME, VERSION, bench.DEFAULT_CACHE, tmp_path)
    assert {name for name, _ in figures["missing_names"]} == REMAINING
    assert figures["mapped"] == 13 and figures["hand_changes"] == []
    probe = figures["probe"]
    assert probe["imports"] == {"modules": 3, "failed": {}}, probe
    (entry,) = probe["entry_points"]
    steps = dict(entry["steps"])
    assert entry["group"] == "asyncengine.platform_plugins"  # the wheel's entry_points.txt, ported
    assert steps["detector"] == "ok: 'vllm_musa_platform.musa.MUSAPlatform'"
    assert steps["Platform subclass"] == "ok" and "is_out_of_tree=True" in steps["predicates"]
    assert steps["check_and_update_config"] == "ok: worker_cls='asyncengine.worker.worker:Worker'"
    assert steps["worker class"] == "ok: Worker, a Worker: True"
