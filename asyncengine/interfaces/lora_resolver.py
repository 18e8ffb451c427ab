"""LoRARequest, and LoRA resolvers (docs/reference.md R11): find an adapter by name the first time a request asks for it.

vLLM's shape: subclass `LoRAResolver`, implement `async resolve_lora(base_model_name, lora_name)` to
return a `LoRARequest` (its `lora_path` a local directory in PEFT's format) or None when it does not
know the name, and register an instance from a general plugin:

    LoRAResolverRegistry.register_resolver("my_resolver", MyResolver())

Read in the frontend only (frontend/lora.py): a request whose `model` is neither the served model nor
a known adapter asks every resolver in turn, the built-in filesystem resolver first (when
`lora_resolver_dir` is set), then the registered ones by name. The first answer wins and is kept
under that name (with an id the frontend assigns, so ids never clash). A resolver that raises fails
that request, naming the resolver; none finding it is a 404 naming the model.

`LoRARequest` (vLLM's `vllm.lora.request.LoRARequest`, also importable from asyncengine.lora.request):
which adapter one request runs with. `lora_int_id` identifies the adapter everywhere below the frontend:
the scheduler counts the distinct ids of a step against `max_loras`, the prefix cache keys blocks by
it, and each worker keeps the adapter's weights under it. Two requests with the same id must therefore
name the same adapter; the frontend hands out ids for the adapters it knows by name. A msgspec Struct,
so it travels to the engine core and the workers as it is.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from asyncengine.interfaces.registry import Registry


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    # A local directory holding adapter_config.json and adapter_model.safetensors.
    lora_path: str
    # The model the adapter was trained on (shown as its parent in /v1/models); None: the served model.
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1 (0 is the base model), got "
                             f"{self.lora_int_id!r} for adapter {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name the adapter's directory, got {self.lora_path!r} for "
                             f"adapter {self.lora_name!r}")

    @property
    def name(self) -> str:  # vLLM's aliases
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAResolver:
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        raise NotImplementedError


@runtime_checkable
class ResolvesLoRA(Protocol):
    """What a LoRA resolver registry entry is: an object with vLLM's async `resolve_lora` (a LoRAResolver
    subclass's instance, or any object that has the method)."""

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None: ...


class _LoRAResolverRegistry(Registry[ResolvesLoRA]):
    def __init__(self) -> None:
        super().__init__("lora_resolvers", "LoRA resolver", ResolvesLoRA, instances=True,
                         expected="an object with an async resolve_lora(base_model_name, lora_name)")

    def register_resolver(self, resolver_name: str, resolver: Any, *, override: bool = False) -> None:
        """vLLM's name: register `resolver` (an object with an async `resolve_lora`) as `resolver_name`."""
        self.register(resolver_name, resolver, override=override)

    def get_supported_resolvers(self) -> list[str]:
        return self.keys()

    def get_resolver(self, resolver_name: str) -> Any:
        entry = self.get(resolver_name)
        if entry is None:
            raise KeyError(f"no LoRA resolver {resolver_name!r} is registered; registered: "
                           f"{', '.join(self.keys()) or 'none'}")
        return entry.implementation


LoRAResolverRegistry = _LoRAResolverRegistry()


__all__ = ["LoRARequest", "LoRAResolver", "LoRAResolverRegistry"]
