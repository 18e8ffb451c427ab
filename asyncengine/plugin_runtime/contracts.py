"""Contracts that would otherwise fail only at the first request, checked at start-up.

A stat logger whose `record` cannot take the engine's arguments, an endpoint plugin without
`attach(app)`, an attention backend without `forward`, an out-of-tree custom op whose forward on this
platform is nobody's: each would pass start-up and kill the engine at its first step. Here each is
found where its role starts (stat loggers and endpoints in the frontend, attention backends and custom
ops in the worker), so start-up (and `asyncengine plugins check`) fails naming the plugin. The checks
bind signatures and look methods up; the only plugin code they run is the platform's
get_attn_backend_cls, asked for a probe shape.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncengine.errors import ConfigError, ModelLoadError, StartupError
from asyncengine.interfaces.registry import BUILT_IN, contract_problem, describe, reads

if TYPE_CHECKING:
    from asyncengine.interfaces.attention import AttentionBackend
    from asyncengine.interfaces.stat_logger import StatLoggerBase
    from asyncengine.interfaces.torch_bases import CustomOp
    from asyncengine.interfaces.platform import Platform
    from asyncengine.config.engine import EngineConfig


def _owner(cls: type, owners: dict[type, str]) -> str:
    return owners.get(cls) or describe(cls)


def check_frontend_contracts(stat_loggers: Sequence[type[StatLoggerBase]], endpoints: list[Any], config: EngineConfig,
                             owners: dict[type, str] | None = None,
                             endpoint_tasks: tuple[str, ...] | None = None) -> None:
    """The stat-logger classes and endpoint plugins the frontend keeps; `owners` names the plugin of each;
    `endpoint_tasks`: the tasks the server serves when not the runner's (the render server's)."""
    from asyncengine.interfaces.stat_logger import INIT_EXTRAS, RECORD_EXTRAS, StatLoggerBase, declared_extras

    owners = owners or {}
    for cls in stat_loggers:
        who = f"stat logger {_owner(cls, owners)}"
        if cls.record is StatLoggerBase.record:
            raise StartupError(f"{who} defines no record(scheduler_stats, iteration_stats): the engine calls it "
                               "after every step")
        init_extras = declared_extras(cls.__init__, tuple(INIT_EXTRAS))[:1]
        record_extras = declared_extras(cls.record, tuple(RECORD_EXTRAS))
        for what, function, arguments, keywords in (
            ("__init__", cls.__init__, (None, config), init_extras),
            ("record", cls.record, (None, None, None), record_extras),
        ):
            try:
                inspect.signature(function).bind(*arguments, **{name: None for name in keywords})
            except TypeError as exc:
                called = ("cls(engine_config" if what == "__init__" else "record(scheduler_stats, iteration_stats") + \
                    "".join(f", {name}=..." for name in keywords) + ")"
                raise StartupError(f"{who}: {what} cannot be called as the engine calls it, {called}: {exc}") from exc
    for endpoint in endpoints:
        check_endpoint_plugin(endpoint, config, owners, endpoint_tasks)


def check_endpoint_plugin(endpoint: Any, config: EngineConfig, owners: dict[type, str] | None = None,
                          tasks: tuple[str, ...] | None = None) -> None:
    """An endpoint plugin adds routes (ours: attach(app); vLLM's: attach_router(app), which needs
    fastapi), and its required_tasks are served here."""
    from asyncengine.interfaces.endpoint import EndpointPlugin, is_router_form, required_tasks_problem

    who = f"endpoint plugin {endpoint.name!r} ({_owner(type(endpoint), owners or {})})"
    problem = required_tasks_problem(endpoint, getattr(config, "runner", None), tasks)
    if problem:
        raise StartupError(f"{who} {problem}")
    if is_router_form(endpoint):
        init_state = getattr(endpoint, "init_state", None)
        if init_state is not None and not callable(init_state):
            raise StartupError(f"{who}: init_state is {init_state!r}, not a method init_state(engine_client, "
                               "state, args)")
        try:  # vLLM's form is a FastAPI router, served as an ASGI app (imported by name: an optional package)
            importlib.import_module("fastapi")
        except ImportError as exc:
            raise StartupError(f"{who} is vLLM's FastAPI form (attach_router): serving it needs the package "
                               f"'fastapi', which cannot be imported here ({exc}): pip install fastapi, or "
                               "port it to attach(app) (docs/porting.md#endpoint-plugins)") from exc
    elif type(endpoint).attach is EndpointPlugin.attach:
        raise StartupError(f"{who} defines no attach(app), which adds its routes (nor vLLM's attach_router(app))")


def check_backend_class(name: str, backend: type[AttentionBackend], origin: str) -> None:
    """An attention backend must implement forward (the selector calls this for each backend it builds)."""
    from asyncengine.interfaces.attention import AttentionBackend

    if getattr(backend, "forward", AttentionBackend.forward) is AttentionBackend.forward:
        raise StartupError(f"attention backend {name!r} ({describe(backend)}, {origin}) defines no "
                           "forward(query, key, value, kv_cache, metadata): vLLM's backends are descriptor classes, "
                           "ours implement attention (docs/porting.md#attention-backends)")


@reads("attention_backends", "worker")
@reads("custom_ops", "worker")
def check_worker_contracts(platform: type[Platform], config: EngineConfig) -> None:
    """Every attention backend a plugin registered, the one the platform (or the attention_backend
    option) chooses for a probe shape (head_dim 64, the platform's default dtype, the configured block
    size: the model's own shapes are asked again when it is built), and every out-of-tree custom op,
    against this platform. The probe calls the platform's get_attn_backend_cls; nothing else runs."""
    from asyncengine.interfaces.attention import AttentionBackendRegistry
    from asyncengine.platforms.interface import ask_attn_backend, attn_backend_name

    for name in AttentionBackendRegistry.keys():
        entry = AttentionBackendRegistry.get(name)
        if entry is not None and entry.owner != BUILT_IN:
            check_backend_class(name, AttentionBackendRegistry.backend_class(name), f"registered by {entry.owner}")
    chosen_by = "the attention_backend option" if config.attention_backend else f"platform {platform.device_name}"
    answer = config.attention_backend or attn_backend_name(ask_attn_backend(platform, 64, _probe_dtype(platform),
                                                                    config.block_size))
    if answer:
        try:
            backend = AttentionBackendRegistry.backend_class(answer, chosen_by=chosen_by)
        except (ConfigError, ModelLoadError):
            backend = None  # unknown or not importable: the selector says so in the load-model phase, with shapes
        if backend is not None:
            check_backend_class(answer, backend, f"chosen by {chosen_by}")
    _check_custom_ops(platform)


def _probe_dtype(platform: type[Platform]) -> Any:
    import torch

    return getattr(torch, platform.default_dtype, torch.float32)


@reads("custom_ops", "worker")
def _check_custom_ops(platform: type[Platform]) -> None:
    from asyncengine.interfaces.custom_op_registry import OOT_PREFIX, CustomOpRegistry, oot_replacement

    replaced = [key[len(OOT_PREFIX):] for key in CustomOpRegistry.keys() if key.startswith(OOT_PREFIX)]
    if not replaced:
        return  # no out-of-tree op: nothing to check, and no reason to import torch here
    from asyncengine.interfaces.torch_bases import CustomOp
    from asyncengine.plugin_runtime.platform_resolution import BUILT_IN as BUILT_IN_PLATFORMS

    for name in replaced:
        op_class = oot_replacement(name)
        if contract_problem(op_class, CustomOp):
            continue  # a class that is no CustomOp is built whole and called as it is
        method = _dispatched(op_class, platform, platform not in BUILT_IN_PLATFORMS.values())
        if method is CustomOp.forward_native:
            entry = CustomOpRegistry.get(OOT_PREFIX + name)
            owner = entry.owner if entry is not None else "nobody"  # `name` came from its keys: registered
            raise StartupError(
                f"out-of-tree custom op {describe(op_class)} for {name!r} (registered by {owner}) has no forward for "
                f"platform {platform.device_name}: define forward_native (the torch reference), forward_oot or "
                f"forward_{platform.device_type}")


@reads("custom_ops", "worker")
def _dispatched(op_class: type[CustomOp], platform: type[Platform], out_of_tree: bool) -> Any:
    """The function CustomOp.forward would run for `op_class` (through the base's forward_oot, which runs
    forward_native)."""
    from asyncengine.interfaces.torch_bases import CustomOp

    for candidate in [f"forward_{platform.device_type}"] + (["forward_oot"] if out_of_tree else []):
        method = getattr(op_class, candidate, None)
        if callable(method):
            return op_class.forward_native if method is CustomOp.forward_oot else method
    return op_class.forward_native
