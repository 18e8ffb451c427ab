# A platform plugin written against vLLM's API, as vLLM's own tests/plugins packages are (our own code).
# tests/e2e/test_vllm_shaped_platform.py ports a copy with `asyncengine plugins port --write` and runs it.
from setuptools import setup

setup(
    name="vllm_shaped_platform",
    version="0.1",
    packages=["vllm_shaped_platform"],
    entry_points={
        # The entry-point name differs from the platform's device_name on purpose.
        "vllm.platform_plugins": ["vllm_shaped = vllm_shaped_platform:platform_plugin"],
        "vllm.general_plugins": ["vllm_shaped_general = vllm_shaped_platform:general_plugin"],
    },
)
