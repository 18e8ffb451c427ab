"""ModelRegistry: architecture name (config.json's `architectures`) -> model class.

Built-in models register here in code, so the engine works from a source tree with no installed
metadata. A class may be given lazily as "package.module:Class"; it is imported when first needed,
and an import error is raised with its traceback (never remembered as "unsupported").
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncengine.errors import ModelLoadError, UnsupportedArchitectureError
from asyncengine.registries.base import BUILT_IN, Registry


def import_by_path(path: str, *, what: str) -> Any:
    """Import "package.module:attr" (or vLLM's "package.module.attr"), raising ModelLoadError that names
    `what` and the path. A class given as an object in this process is found under its path first."""
    from asyncengine.config.class_paths import is_class_path, remembered_class, split_class_path

    if not is_class_path(path):
        raise ModelLoadError(f"{what}: {path!r} is not of the form 'package.module:Class' (or 'package.module.Class')")
    remembered = remembered_class(path)
    if remembered is not None:
        return remembered
    splits = split_class_path(path)
    not_found: ModelLoadError | None = None  # the first split's "no such module", reported if no split works
    for index, (module_name, attr) in enumerate(splits):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            error = ModelLoadError(f"{what}: importing {module_name!r} failed: {exc}")
            error.__cause__ = exc
            if exc.name == module_name and index + 1 < len(splits):
                not_found = not_found or error
                continue  # dotted "a.b.C": no module "a.b", so maybe module "a" with attribute "b.C"
            raise not_found or error
        except ImportError as exc:
            raise ModelLoadError(f"{what}: importing {module_name!r} failed: {exc}") from exc
        target: Any = module
        for part in attr.split("."):
            if not hasattr(target, part):
                raise not_found or ModelLoadError(f"{what}: module {module_name!r} has no attribute {attr!r}")
            target = getattr(target, part)
        return target
    raise AssertionError("unreachable: split_class_path gives at least one split for a class path")


class _ModelRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("models", "model architecture")
        for architecture, path in {
            "LlamaForCausalLM": "asyncengine.models.llama:LlamaForCausalLM",
            "Qwen2ForCausalLM": "asyncengine.models.qwen2:Qwen2ForCausalLM",
            "Qwen3ForCausalLM": "asyncengine.models.qwen3:Qwen3ForCausalLM",
        }.items():
            self.register(architecture, path, owner=BUILT_IN)

    def register_model(self, architecture: str, model: Any, *, override: bool = False) -> None:
        """Register `model` (a class, or "package.module:Class") under `architecture` (vLLM's name)."""
        self.register(architecture, model, override=override)

    def get_supported_archs(self) -> list[str]:
        return self.keys()

    def is_supported(self, architecture: str) -> bool:
        return architecture in self

    def resolve(self, architectures: list[str], overrides: dict[str, str] | None = None) -> tuple[str, type]:
        """The first of `architectures` that has a class (config-given overrides win), and that class."""
        overrides = overrides or {}
        for architecture in architectures:
            entry = overrides.get(architecture)
            if entry is None:
                registered = self.get(architecture)
                entry = registered.implementation if registered else None
            if entry is None:
                continue
            if isinstance(entry, str):
                entry = import_by_path(entry, what=f"model class for {architecture}")
            return architecture, entry
        raise UnsupportedArchitectureError(
            f"model architecture(s) {', '.join(architectures) or '(none given)'} not supported; "
            f"supported: {', '.join(self.get_supported_archs())}"
        )


ModelRegistry = _ModelRegistry()
