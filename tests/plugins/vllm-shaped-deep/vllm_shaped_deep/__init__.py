"""vLLM-shaped plugins that only a started worker exercises. DEEP_FAIL (an environment variable) names what
breaks on purpose: "init_device" (the worker class's), "set_device" (the platform's hook, in the worker)."""

import os


def failing(what):
    return os.environ.get("DEEP_FAIL") == what


def platform_plugin():
    return "vllm_shaped_deep.platform.DeepPlatform"


def register_quantization():
    import vllm_shaped_deep.quantization  # noqa: F401  (its decorators register the methods)
