"""A general plugin written as a coroutine: it awaits before it registers, on the process's event loop."""

import anyio

from asyncengine.plugins_api import ModelRegistry


async def register():
    await anyio.sleep(0.05)
    ModelRegistry.register_model("AsyncPluginLlamaForCausalLM", "asyncengine.models.llama:LlamaForCausalLM")
