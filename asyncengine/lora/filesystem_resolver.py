"""The built-in LoRA resolver: a directory with one adapter (PEFT's format) per sub-directory, as vLLM's
`lora_filesystem_resolver`. Set `lora_resolver_dir` (or ASYNCENGINE_LORA_RESOLVER_CACHE_DIR); a request
for model "x" then finds `<dir>/x/adapter_config.json` on first use."""

from __future__ import annotations

import os

import anyio

from asyncengine.interfaces.lora_resolver import LoRAResolver
from asyncengine.lora.peft import CONFIG_FILE
from asyncengine.interfaces.lora_resolver import LoRARequest

RESOLVER_DIR_ENV = "ASYNCENGINE_LORA_RESOLVER_CACHE_DIR"


class FilesystemResolver(LoRAResolver):
    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        # A name is one directory entry, never a path: "../x" or "a/b" must not reach outside the directory.
        if not lora_name or lora_name in (".", "..") or "/" in lora_name or os.sep in lora_name or "\0" in lora_name:
            return None
        path = os.path.join(self.directory, lora_name)
        found = await anyio.to_thread.run_sync(os.path.isfile, os.path.join(path, CONFIG_FILE))
        if not found:
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=path, base_model_name=base_model_name)

    def __repr__(self) -> str:
        return f"FilesystemResolver({self.directory!r})"


def configured_resolver_dir(configured: str | None) -> str | None:
    return configured or os.environ.get(RESOLVER_DIR_ENV) or None


__all__ = ["FilesystemResolver", "RESOLVER_DIR_ENV", "configured_resolver_dir"]
