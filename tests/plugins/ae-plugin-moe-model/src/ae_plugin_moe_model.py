"""Registers architecture `MoeTestForCausalLM` (lazily, by path: registering imports no torch).

A test-only model: no MoE architecture ships in asyncengine yet, and the end-to-end test of the MoE op's
providers (tests/e2e/test_moe_plugin.py) needs a model whose layers call op "fused_moe" in the worker."""

from asyncengine.plugins_api import ModelRegistry

ARCHITECTURE = "MoeTestForCausalLM"


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, "ae_plugin_moe_model_net:MoeTestForCausalLM")
