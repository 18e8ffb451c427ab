# A general plugin written against vLLM's API (our own code, in vLLM's style): it replaces the SiluAndMul op with
# one that leans on vLLM's helpers, `init_logger`, `vllm.distributed` (its rank, world size and all-reduce) and
# `vllm.utils` (cdiv, round_up). tests/plugin_runtime/test_vllm_shaped_distributions.py ports a copy with
# `asyncengine plugins port --write` and runs it in-process, multiprocess and at TP=2.
from setuptools import setup

setup(
    name="vllm_shaped_general",
    version="0.1",
    packages=["vllm_shaped_general"],
    entry_points={"vllm.general_plugins": ["shaped_chunked_ops = vllm_shaped_general:register"]},
)
