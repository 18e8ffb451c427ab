"""Two LoRA resolvers, registered from a general plugin as a vLLM resolver plugin does.

- "env_dir": adapter NAME is the directory $AE_TEST_LORA_DIR/NAME (a stand-in for a model hub download);
- "explosive": raises for any name starting with "explode" (the request must fail naming this resolver).
"""

from __future__ import annotations

import os

from asyncengine.plugins_api import LoRARequest, LoRAResolver, LoRAResolverRegistry


class EnvDirResolver(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        root = os.environ.get("AE_TEST_LORA_DIR")
        if not root or "/" in lora_name or lora_name.startswith("."):
            return None
        path = os.path.join(root, lora_name)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=abs(hash(lora_name)) % 10**6 + 1, lora_path=path,
                           base_model_name=base_model_name)


class ExplosiveResolver(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if lora_name.startswith("explode"):
            raise RuntimeError(f"the adapter store is unreachable for {lora_name}")
        return None


def register() -> None:
    LoRAResolverRegistry.register_resolver("env_dir", EnvDirResolver())
    LoRAResolverRegistry.register_resolver("explosive", ExplosiveResolver())
