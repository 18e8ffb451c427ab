"""The frontend's adapters: which LoRARequest a name means, and the checks a request's adapter gets.

Names come from `lora_modules` (at start-up), from runtime loads (POST /v1/load_lora_adapter), and
from the LoRA resolvers (a name nobody knows yet: the built-in filesystem resolver, then the
registered ones, docs/reference.md R11). Each name gets an id of its own, never reused (an unloaded
adapter's id stays retired: the prefix cache keys blocks by it, and workers cache weights under it).

A `LoRARequest` given directly (`LLM.generate(..., lora_request=...)`) keeps the caller's id; one id
must keep naming one directory, which `check` holds to.

No adapter may take the served model's name (the name `/v1/models` lists it under, which a request's
`model` selects it by): at start-up that is a configuration error, at a runtime load a 400. An adapter's
files are read in a worker thread within ADAPTER_READ_TIMEOUT_S (lora/peft.py bounds what is read).

A name is registered only for an adapter that fits the model: `load` and `resolve` ask the workers
(`fits_on_workers`: every matrix's shape against the layers it targets, lora/pool.py), and the workers
check `lora_modules` themselves at start-up. A `LoRARequest` given directly is checked by the worker
when its request arrives there (that request alone fails).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from asyncengine.config.engine import EngineConfig
from asyncengine.config.lora import parse_lora_modules
from asyncengine.errors import AsyncEngineError, ConfigError, RequestError
from asyncengine.interfaces.lora_resolver import LoRAResolverRegistry
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import reads
from asyncengine.lora.filesystem_resolver import FilesystemResolver, configured_resolver_dir
from asyncengine.lora.peft import LoRAAdapterError, read_adapter_config
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.wire.startup import StartupRecord

# Ids the frontend hands out start here, far from the small ids callers of LLM.generate pick by hand.
_FIRST_ASSIGNED_ID = 1_000_001

# The most seconds the frontend waits for an adapter's files to be read and checked (docs/lora.md, "Limits"):
# they are regular files of bounded size, so only a stalled filesystem gets near it.
ADAPTER_READ_TIMEOUT_S = 10.0

# The check that an adapter fits the served model (`fits_on_workers`, bound to an engine): RequestError if not.
FitCheck = Callable[[LoRARequest], Awaitable[None]]


class LoRAResolverFailed(AsyncEngineError):
    """A LoRA resolver raised while looking up an adapter: that request fails, naming the resolver."""

    def __init__(self, resolver: str, lora_name: str, error: BaseException) -> None:
        super().__init__(f"LoRA resolver {resolver!r} failed while looking up adapter {lora_name!r}: "
                         f"{type(error).__name__}: {error}")
        self.resolver = resolver
        self.lora_name = lora_name


class LoRAAdapters:
    def __init__(self, config: EngineConfig, served_model_name: str | None = None) -> None:
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.served_model_name = served_model_name
        self._ids = itertools.count(_FIRST_ASSIGNED_ID)
        self._by_name: dict[str, LoRARequest] = {}
        self._path_of_id: dict[int, str] = {}
        for module in parse_lora_modules(config.lora_modules):
            if module.name == served_model_name:
                raise ConfigError(f"lora_modules: the adapter name {module.name!r} is the served model's name; a "
                                  "request's model would be both: give the adapter another name (or the model "
                                  "another --served-model-name)", field="lora_modules")
            self._by_name[module.name] = self._named(module.name, module.path, module.base_model_name)
        resolver_dir = configured_resolver_dir(config.lora_resolver_dir) if self.enabled else None
        self.filesystem_resolver = FilesystemResolver(resolver_dir) if resolver_dir else None

    # -- names -------------------------------------------------------------------------------------------

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    async def load(self, name: str, path: str, base_model_name: str | None = None, *,
                   fits: FitCheck) -> LoRARequest:
        """Add adapter `name`: its config read and checked in a worker thread, then `fits` (the workers' check
        of every matrix against the model); registered only when both pass. RequestError when the name is
        taken or the adapter refused."""
        self._require_enabled()
        self._require_free(name)
        lora = self._named(name, path, base_model_name)
        await self.check_off_loop(lora)
        await fits(lora)
        self._require_free(name)  # another load may have taken the name meanwhile
        self._by_name[name] = lora
        return lora

    def _require_free(self, name: str) -> None:
        if name == self.served_model_name:
            raise RequestError(f"the LoRA adapter name {name!r} is the served model's name: a request's model "
                               "would be both; give the adapter another name", field="lora_name",
                               code="lora_name_taken")
        if name in self._by_name:
            raise RequestError(f"the LoRA adapter {name!r} is already loaded; unload it first", field="lora_name",
                               code="lora_already_loaded")

    def unload(self, name: str) -> LoRARequest | None:
        """Forget adapter `name` (requests running with it finish); None when no adapter has that name."""
        return self._by_name.pop(name, None)

    def _named(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        lora_id = next(self._ids)
        try:
            return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=os.path.abspath(path),
                               base_model_name=base_model_name)
        except ValueError as exc:
            raise RequestError(str(exc), field="lora_name") from exc

    @reads("lora_resolvers", "frontend")
    async def resolve(self, base_model_name: str, name: str, fits: FitCheck | None = None) -> LoRARequest | None:
        """The adapter called `name`: known, or found by a resolver now (and kept, once its config and `fits`,
        the workers' check against the model, pass); None if nobody has it."""
        known = self._by_name.get(name)
        if known is not None or not self.enabled:
            return known
        resolvers: list[tuple[str, Any]] = []
        if self.filesystem_resolver is not None:
            resolvers.append(("filesystem (built-in)", self.filesystem_resolver))
        resolvers += [(key, _resolver_object(key)) for key in LoRAResolverRegistry.keys()]
        for resolver_name, resolver in resolvers:
            try:
                found = await resolver.resolve_lora(base_model_name, name)
            except Exception as exc:  # the resolver's own failure: this request fails, naming it
                raise LoRAResolverFailed(resolver_name, name, exc) from exc
            if found is None:
                continue
            if not isinstance(found, LoRARequest):
                raise LoRAResolverFailed(resolver_name, name, TypeError(
                    f"resolve_lora returned {type(found).__name__}, not a LoRARequest or None"))
            known = self._by_name.get(name)  # another request may have resolved it meanwhile
            if known is not None:
                return known
            lora = self._named(name, found.lora_path, found.base_model_name or base_model_name)
            try:
                await self.check_off_loop(lora)
                if fits is not None:
                    await fits(lora)
            except RequestError as exc:
                raise RequestError(f"LoRA resolver {resolver_name!r} found {name!r}, but: {exc.message}",
                                   field=exc.field, source=resolver_name) from exc
            return self._by_name.setdefault(name, lora)  # another request may have resolved it meanwhile
        return None

    # -- checks ------------------------------------------------------------------------------------------

    def check(self, lora: Any) -> None:
        """A request's adapter, before it is queued: RequestError (field lora_request, or the config key)."""
        self._require_enabled()
        if not isinstance(lora, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}", field="lora_request")
        path = self._path_of_id.get(lora.lora_int_id)
        if path is not None and path != lora.lora_path:
            raise RequestError(f"lora_int_id {lora.lora_int_id} already names the adapter at {path}; give "
                               f"{lora.lora_name!r} ({lora.lora_path}) an id of its own", field="lora_request")
        if path is None:
            try:
                read_adapter_config(lora.lora_path, max_rank=self.max_rank, name=lora.lora_name)
            except LoRAAdapterError as exc:
                raise RequestError(str(exc), field=f"lora_request.{exc.field}") from exc
            self._path_of_id[lora.lora_int_id] = lora.lora_path

    async def check_off_loop(self, lora: Any) -> None:
        """`check`, reading an adapter's config in a worker thread the first time (never on the event loop),
        within ADAPTER_READ_TIMEOUT_S: past it, a RequestError (the thread is left to finish on its own)."""
        if isinstance(lora, LoRARequest) and self.enabled and lora.lora_int_id not in self._path_of_id:
            with anyio.move_on_after(ADAPTER_READ_TIMEOUT_S) as reading:
                await anyio.to_thread.run_sync(self.check, lora, abandon_on_cancel=True)
            if reading.cancelled_caught:
                raise RequestError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): its files were not read "
                                   f"within {ADAPTER_READ_TIMEOUT_S:g} s; is its filesystem stalled?",
                                   field="lora_request.lora_path")
        else:
            self.check(lora)

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise RequestError("this engine was started without enable_lora (--enable-lora): it serves no LoRA "
                               "adapters", field="lora_request")

    # -- the start-up report -----------------------------------------------------------------------------

    def startup_record(self, role: str) -> StartupRecord:
        resolvers = ([f"filesystem (built-in: {self.filesystem_resolver.directory})"] if self.filesystem_resolver
                     else []) + [f"{key} (by {LoRAResolverRegistry.registered(key).owner})"
                                 for key in LoRAResolverRegistry.keys()]
        adapters = ", ".join(f"{lora.lora_name}={lora.lora_path}" for lora in self._by_name.values())
        if not self.enabled:
            return StartupRecord(pid=os.getpid(), role=role, phase="ready", plugin="lora", outcome="skipped",
                                 reason="enable_lora is off", start=time.time())
        return StartupRecord(pid=os.getpid(), role=role, phase="ready", plugin="lora", start=time.time(),
                             reason=f"adapters: {adapters or 'none'}; resolvers: {', '.join(resolvers) or 'none'}")


async def fits_on_workers(collective_rpc: Callable[..., Awaitable[list[Any]]], lora: LoRARequest) -> None:
    """Whether `lora` fits the served model, asked of every worker through `collective_rpc`
    (Worker.check_lora_adapter, on the workers' own threads: the config and the safetensors header, no
    slot taken); RequestError with the first refusal (the adapter, the layer and both shapes) when not."""
    answers = await collective_rpc("check_lora_adapter", args=[lora.lora_name, lora.lora_path])
    for refused in answers:
        if refused is not None:
            raise RequestError(refused["message"], field=f"lora_request.{refused['field']}",
                               code="lora_adapter_mismatch")


def _resolver_object(key: str) -> Any:
    implementation = LoRAResolverRegistry.registered(key).implementation
    if isinstance(implementation, str):  # registered by "pkg.mod:attr" path: imported when first asked
        implementation = import_by_path(implementation, what=f"LoRA resolver {key!r}")
    return implementation


__all__ = ["ADAPTER_READ_TIMEOUT_S", "FitCheck", "LoRAAdapters", "LoRAResolverFailed", "fits_on_workers"]
