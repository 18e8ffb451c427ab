# A platform plugin in the shape of vLLM's own test platform (our own code): its device is
# "privateuseone", which torch has no backend for on this machine, and its attention backend is a
# PlaceholderAttentionBackend subclass reached through vLLM's older selector.
# tests/plugins/test_vllm_form_tests.py ports a copy with `asyncengine plugins port --write` and runs it.
from setuptools import setup

setup(
    name="vllm_shaped_privateuse",
    version="0.1",
    packages=["vllm_shaped_privateuse"],
    entry_points={
        "vllm.platform_plugins": ["privateuse_platform = vllm_shaped_privateuse:platform_plugin"],
    },
)
