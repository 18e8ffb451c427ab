# Plugins written against vLLM's API for `asyncengine plugins check --deep` and vLLM's quantization contract
# (our own code, in vLLM's style): a platform whose worker_cls subclasses vLLM's CPU worker, and a general
# plugin registering a QuantizationConfig whose LinearMethodBase runs its own int8 GEMM.
# tests/plugin_runtime/test_deep_check.py and tests/models/test_vllm_quantization.py port a copy with
# `asyncengine plugins port --write` and run it.
from setuptools import setup

setup(
    name="vllm_shaped_deep",
    version="0.1",
    packages=["vllm_shaped_deep"],
    entry_points={
        "vllm.platform_plugins": ["deep_platform = vllm_shaped_deep:platform_plugin"],
        "vllm.general_plugins": ["deep_quant = vllm_shaped_deep:register_quantization"],
    },
)
