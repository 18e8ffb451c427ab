"""Placement, decided here once: where the engine core and the worker run, and so which roles each process plays.

Two switches (docs/architecture.md, "Processes and roles"):
- `in_process`: the engine core runs in the frontend's event loop (embedding, tests), or in a process of
  its own (the default of `asyncengine serve`);
- `distributed_executor_backend`: "uni" runs the worker on a thread of the engine core's process, "mp" one
  process per rank ("ray": the same processes, started on Ray's nodes); unset, "uni" for one rank and "mp"
  for more (EngineConfig.executor_backend). A
  "pkg.mod:Executor" places its workers as its class says (`Executor.worker_placement`: UniExecutor's
  subclasses "uni", every other executor "mp").

A process's roles decide which plugin groups it loads, which config hooks it checks and which registries
its manifest check compares; so the frontend's start, the engine-core process, its `plugins check`, the
CLI's `plugins check` and the `plugins timeline` plan all ask here (the frontend's core client reads
`in_process` itself, to pick the client: nothing else follows from it). It lives in the plugin runtime, not the
config, because a class-path executor is imported and checked (the config-hooks phase's check) to learn
where it puts its workers.
"""

from __future__ import annotations

from asyncengine.config.engine import EngineConfig
from asyncengine.interfaces.roles import ENGINE_CORE, FRONTEND, WORKER

UNI, MP, RAY = "uni", "mp", "ray"


def worker_placement(config: EngineConfig) -> str:
    """UNI when the worker runs on a thread of the engine core's process, else MP (worker processes)."""
    backend = config.executor_backend
    if backend in (UNI, MP):
        return backend
    if backend == RAY:  # worker processes too, started on the Ray nodes
        return MP
    from asyncengine.plugin_runtime.config_hooks import load_hook

    # The same import and check as the config-hooks phase: a path that does not import, or names no
    # Executor, is a ConfigError naming the option here already, rather than a guess at the placement.
    return load_hook("distributed_executor_backend", backend).worker_placement


def worker_in_engine_core(config: EngineConfig) -> bool:
    return worker_placement(config) == UNI


def frontend_roles(config: EngineConfig) -> set[str]:
    """The roles the frontend's process plays: in-process it is also the engine core, and with "uni"
    the worker (its thread)."""
    roles = {FRONTEND}
    if config.in_process:
        roles |= engine_core_roles(config)
    return roles


def engine_core_roles(config: EngineConfig) -> set[str]:
    """The roles of the process the engine core runs in, besides the frontend's when in-process: the
    engine core's, and the worker's too when the worker is a thread of it."""
    return {ENGINE_CORE} | ({WORKER} if worker_in_engine_core(config) else set())


__all__ = ["MP", "UNI", "engine_core_roles", "frontend_roles", "worker_in_engine_core", "worker_placement"]
