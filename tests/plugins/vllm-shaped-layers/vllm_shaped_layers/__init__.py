"""Registers ShapedLlamaForCausalLM, a Llama written as vLLM's model files are (model.py), as a general plugin."""

from vllm import ModelRegistry


def register():
    if "ShapedLlamaForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("ShapedLlamaForCausalLM", "vllm_shaped_layers.model:ShapedLlamaForCausalLM")
