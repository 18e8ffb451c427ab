# A model loader written against vLLM's API (our own code, in vLLM's style): a BaseModelLoader subclass
# registered with @register_model_loader from a general plugin, reading its settings from
# model_loader_extra_config and the checkpoint through vLLM's safetensors iterator.
# tests/plugin_runtime/test_vllm_shaped_distributions.py ports a copy with `asyncengine plugins port --write`.
from setuptools import setup

setup(
    name="vllm_shaped_loader",
    version="0.1",
    packages=["vllm_shaped_loader"],
    entry_points={"vllm.general_plugins": ["shaped_loader = vllm_shaped_loader:register"]},
)
