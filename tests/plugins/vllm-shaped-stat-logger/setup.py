# A stat-logger plugin written against vLLM's API (our own code, in the shape of vLLM's test plugins).
# tests/e2e/test_vllm_shaped_stat_logger.py ports a copy with `asyncengine plugins port --write` and runs it.
from setuptools import setup

setup(
    name="vllm_shaped_stat_logger",
    version="0.1",
    packages=["vllm_shaped_stat_logger"],
    entry_points={
        "vllm.stat_logger_plugins": ["vllm_shaped_stats = vllm_shaped_stat_logger:CountingStatLogger",
                                     "vllm_shaped_minimal = vllm_shaped_stat_logger:MinimalStatLogger"],
    },
)
