"""The LoRA options of EngineConfig (docs/lora.md), checked: vLLM's names and meanings.

`enable_lora` turns multi-LoRA serving on; `max_loras` adapters may be used in one step (the
slots of each worker's pool), `max_lora_rank` is the largest rank served, `max_cpu_loras` adapters are
kept read in each worker's CPU cache (default: max_loras). `lora_modules` names adapters at start-up:
`name=path` strings, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`.
`lora_resolver_dir`: the built-in filesystem resolver's directory (one adapter per sub-directory,
found by name on first use); default: the environment variable ASYNCENGINE_LORA_RESOLVER_CACHE_DIR.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncengine.errors import ConfigError


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(value: list[Any] | None) -> list[LoRAModule]:
    modules: list[LoRAModule] = []
    for item in value or []:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"lora_modules: {item!r} is not name=path (or a JSON object with name and path)",
                                  field="lora_modules")
            modules.append(LoRAModule(name.strip(), path.strip()))
        elif isinstance(item, dict):
            given_name, given_path = item.get("name"), item.get("path")
            unknown = sorted(set(item) - {"name", "path", "base_model_name"})
            if (not isinstance(given_name, str) or not given_name or not isinstance(given_path, str) or not given_path
                    or unknown):
                raise ConfigError(f"lora_modules: {item!r} needs string 'name' and 'path' (and optionally "
                                  f"'base_model_name'){'; unknown keys: ' + ', '.join(unknown) if unknown else ''}",
                                  field="lora_modules")
            base = item.get("base_model_name")
            modules.append(LoRAModule(given_name, given_path, base if isinstance(base, str) else None))
        else:
            raise ConfigError(f"lora_modules: {item!r} is neither name=path nor a JSON object", field="lora_modules")
    names = [module.name for module in modules]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"lora_modules names {', '.join(duplicates)} more than once", field="lora_modules")
    return modules


def check_lora_options(config: Any) -> None:
    for name in ("max_loras", "max_lora_rank"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(config, name)}", field=name)
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ConfigError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})",
                          field="max_cpu_loras")
    modules = parse_lora_modules(config.lora_modules)
    if modules and not config.enable_lora:
        raise ConfigError("lora_modules needs enable_lora (--enable-lora)", field="lora_modules")


__all__ = ["LoRAModule", "check_lora_options", "parse_lora_modules"]
