"""asyncengine: an async-native LLM inference and serving engine.

    from asyncengine import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from asyncengine import _ops_path  # noqa: F401  (makes asyncengine.ops importable from a source tree)
from asyncengine._version import __version__
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import EngineDeadError, EngineOverloadedError, RequestError, StartupError
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.structured_output_spec import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "LoRARequest",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StartupError",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    # LLM and AsyncEngine pull in the engine; import them only when asked for, so `import asyncengine`
    # (the CLI's --help, config tools) stays fast.
    if name == "LLM":
        from asyncengine.frontend.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from asyncengine.frontend.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")
