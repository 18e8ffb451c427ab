# A model plugin written against vLLM's API (our own code, in the shape of vLLM's test plugins).
from setuptools import setup

setup(
    name="vllm_shaped_model",
    version="0.1",
    packages=["vllm_shaped_model"],
    entry_points={"vllm.general_plugins": ["register_shaped_model = vllm_shaped_model:register"]},
)
