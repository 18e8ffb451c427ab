# An IO processor written against vLLM's API (our own code, in vLLM's style): IOProcessor[In, Out] with pydantic
# input and output models, parse_data / merge_pooling_params / pre_process / post_process and the request id,
# over per-token embeddings (the token_embed task, as ColBERT-style processors use it).
# tests/plugin_runtime/test_vllm_shaped_distributions.py ports a copy with `asyncengine plugins port --write`.
from setuptools import setup

setup(
    name="vllm_shaped_io",
    version="0.1",
    packages=["vllm_shaped_io"],
    entry_points={"vllm.io_processor_plugins": ["shaped_maxsim = vllm_shaped_io:get_processor_cls"]},
)
