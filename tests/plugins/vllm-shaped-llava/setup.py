# A multimodal model plugin written against vLLM's API (our own code, in the shape of vLLM's
# tests/plugins/vllm_add_dummy_model: a LLaVA subclass registered lazily by a general plugin).
from setuptools import setup

setup(
    name="vllm_shaped_llava",
    version="0.1",
    packages=["vllm_shaped_llava"],
    entry_points={"vllm.general_plugins": ["register_shaped_llava = vllm_shaped_llava:register"]},
)
