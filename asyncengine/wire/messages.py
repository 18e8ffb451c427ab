"""Every message between processes: the start-up hand-shake, frontend <-> engine core, engine core <-> worker.

Each is a tagged msgspec Struct; a connection decodes into the union of what its peer may send.
Method calls travel by registered name with msgspec-encodable arguments (`UtilityCall`, `WorkerCall`).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.wire.engine_core import EngineCoreOutputs, EngineCoreRequest
from asyncengine.wire.startup import Manifest, StartupRecord
from asyncengine.wire.worker import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class Message(msgspec.Struct, tag=True, kw_only=True):
    pass


# -- hand-shake (child -> parent: Hello, then Ready or StartupFailed; parent -> child: StartupParams) ---


class Hello(Message):
    secret: str
    role: str  # "engine core" or "worker"
    rank: int
    pid: int


class StartupParams(Message):
    """Start serving: the plugin phases, then the role's work (the model, the KV cache, the step loop)."""

    engine_config: EngineConfig
    model_config: ModelConfig
    platform: str  # the platform the frontend resolved (its device name)
    manifest: Manifest | None = None
    rank: int = 0
    world_size: int = 1
    # torch.distributed rendezvous ("tcp://127.0.0.1:PORT") when world_size > 1
    distributed_init_method: str | None = None


class CheckParams(Message):
    """`asyncengine plugins check`: run the plugin phases (the engine core starts its workers' too),
    say Ready and exit; no model, no device."""

    engine_config: EngineConfig
    platform: str
    manifest: Manifest | None = None
    rank: int = 0
    world_size: int = 1


class Ready(Message):
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    records: list[StartupRecord] = msgspec.field(default_factory=list)  # this process's and its children's


class StartupFailed(Message):
    phase: str
    error: str
    records: list[StartupRecord] = msgspec.field(default_factory=list)
    error_type: str | None = None  # the exception's class name, rebuilt on the other side (errors.py)
    error_field: str | None = None


# -- frontend -> engine core ----------------------------------------------------------------------------


class AddRequests(Message):
    requests: list[EngineCoreRequest]


class AbortRequests(Message):
    request_ids: list[str]


class UtilityCall(Message):
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class Shutdown(Message):
    pass


# -- engine core -> frontend ----------------------------------------------------------------------------


class UtilityResult(Message):
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    error_field: str | None = None  # RequestError/ConfigError.field


class EngineCoreDead(Message):
    """Sent by the engine core just before it stops because something died or failed under it."""

    process: str
    cause: str
    # What killed it, when an exception did (EngineDeadError's fields; never the pickled exception):
    # its qualified type name, its str(), and the code/process/phase that raised it.
    cause_type: str | None = None
    cause_message: str | None = None
    culprit: str | None = None


# -- engine core -> worker ------------------------------------------------------------------------------


class ExecuteModel(Message):
    scheduler_output: SchedulerOutput


class GrammarMasks(Message):
    """The masks of the oldest step this rank holds whose masks follow it (structured_output/deferred.py):
    one per step sent with `deferred_grammar_request_ids`, in the order of those steps."""

    bitmask: GrammarBitmask | None = None


class WorkerCall(Message):
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] | None = None  # the method's keyword arguments; None: none


# -- worker -> engine core ------------------------------------------------------------------------------


class StepResult(Message):
    output: ModelRunnerOutput | None = None
    error: str | None = None
    error_type: str | None = None  # the exception's qualified type name
    error_message: str | None = None  # its str()
    culprit: str | None = None  # the code that raised it, this process, the phase


class WorkerCallResult(Message):
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    error_field: str | None = None  # RequestError/ConfigError.field


# What each side of each connection may receive.
FrontendInbox = Union[Hello, Ready, StartupFailed, EngineCoreOutputs, UtilityResult, EngineCoreDead]
EngineCoreInbox = Union[StartupParams, CheckParams, AddRequests, AbortRequests, UtilityCall, Shutdown]
ExecutorInbox = Union[Hello, Ready, StartupFailed, StepResult, WorkerCallResult]
WorkerInbox = Union[StartupParams, CheckParams, ExecuteModel, GrammarMasks, WorkerCall, Shutdown]
