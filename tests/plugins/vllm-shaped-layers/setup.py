# A model written against vLLM's layers and weight loaders (our own code, in the shape of vLLM's model files).
from setuptools import setup

setup(
    name="vllm_shaped_layers",
    version="0.1",
    packages=["vllm_shaped_layers"],
    entry_points={"vllm.general_plugins": ["register_shaped_layers = vllm_shaped_layers:register"]},
)
