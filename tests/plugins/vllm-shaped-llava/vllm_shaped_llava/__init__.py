"""Registers MyLlava (vLLM's LLaVA whose logits always pick token 0) by its lazy "module:Class" path."""

from vllm import ModelRegistry


def register():
    if "MyLlava" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("MyLlava", "vllm_shaped_llava.my_llava:MyLlava")
