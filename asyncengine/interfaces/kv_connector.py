"""The KV connector interface (a scheduler side in the engine core, a worker side in every worker rank),
and the table of connectors (KVConnectorFactory).

One class, built twice (as vLLM's v1 connectors are): once with role SCHEDULER in the engine core, once
with role WORKER in each worker (a process per rank with `mp`, a thread of the engine core with `uni`).
The two halves never share memory: per step, the scheduler side describes what to load and save in a
`KVConnectorMetadata` (a msgspec Struct of the connector's own), which travels to every worker inside
the step's SchedulerOutput as msgpack bytes and is decoded there as `metadata_cls`. No pickle.

Scheduler side, in the order the scheduler calls it:
  get_num_new_matched_tokens(request, num_computed_tokens) -> int
      when a waiting request is about to be admitted: how many prompt tokens after the
      `num_computed_tokens` already in the local prefix cache the connector can supply. The engine never
      lets it supply the last prompt token (its logits are needed): a larger answer is cut.
  update_state_after_alloc(request, num_external_tokens)
      once blocks are allocated (request.block_ids), with the count the engine accepted.
  build_connector_meta(requests) -> KVConnectorMetadata | None
      once per step, with a view of every request scheduled in it.
  request_finished(request)
      when a request finishes or is aborted (its blocks are freed right after).

Worker side, per step, around the forward pass (synchronously: the step waits for both):
  register_kv_caches(kv_caches)    once, with the paged cache: per layer (key, value), each of shape
                                   (num_kv_heads of this rank, num_blocks, block_size, head_dim)
  start_load_kv(metadata)          before the forward: fill the blocks the scheduler side promised
  wait_for_save(metadata)          after the forward: save what it asked to save
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from asyncengine.config.kv_transfer import KVTransferConfig
from asyncengine.errors import ConfigError
from asyncengine.interfaces.registry import BUILT_IN, Registry

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # runs in the engine core
    WORKER = "worker"  # runs in each worker rank


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Base of a connector's per-step metadata: subclass it (it must encode with msgspec)."""


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector may need to know about where it runs, in either role."""

    block_size: int
    tensor_parallel_size: int
    rank: int  # the worker's rank; 0 on the scheduler side
    architecture: str
    dtype: str  # "float32", "bfloat16", ...
    model: str  # the served model name
    engine_config: EngineConfig | None = None
    model_config: ModelConfig | None = None


@dataclass(frozen=True)
class KVConnectorRequest:
    """The scheduler side's view of one request. Read-only: the lists are the engine's own."""

    request_id: str
    prompt_token_ids: list[int]
    # The prefix-caching chain hashes of the prompt's full blocks (block i covers tokens
    # [i * block_size, (i + 1) * block_size)); equal hashes mean equal prefixes.
    block_hashes: list[bytes]
    block_ids: list[int]
    num_computed_tokens: int  # before this step (in a lookup: the local prefix cache's hit)
    num_scheduled_tokens: int = 0  # tokens computed for it in this step (0 outside build_connector_meta)
    num_external_tokens: int = 0  # tokens the connector supplied when it was admitted
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class KVConnectorBase:
    """Subclass it and register the subclass: KVConnectorFactory.register_connector("name", "pkg.mod", "Class").

    The defaults supply nothing and save nothing, so a connector overrides only what it does.
    """

    metadata_cls: type[KVConnectorMetadata] = KVConnectorMetadata

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext) -> None:
        self.config = config
        self.role = role
        self.context = context

    def describe(self) -> str:
        """One line for the start-up report, after the class and its origin (default: nothing)."""
        return ""

    # -- scheduler side (engine core) ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: KVConnectorRequest, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request: KVConnectorRequest, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, requests: list[KVConnectorRequest]) -> KVConnectorMetadata | None:
        return None

    def request_finished(self, request: KVConnectorRequest) -> None:
        return None

    # -- worker side (each worker rank) -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]]) -> None:
        return None

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        return None

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        return None

    # -- the metadata's trip from the engine core to the workers -------------------------------------

    @classmethod
    def encode_metadata(cls, metadata: KVConnectorMetadata) -> bytes:
        if not isinstance(metadata, cls.metadata_cls):
            raise TypeError(f"{cls.__qualname__}.build_connector_meta returned {type(metadata).__qualname__}, not "
                            f"its metadata_cls {cls.metadata_cls.__qualname__}")
        return msgspec.msgpack.encode(metadata)

    @classmethod
    def decode_metadata(cls, data: bytes) -> KVConnectorMetadata:
        return msgspec.msgpack.decode(data, type=cls.metadata_cls)


# -- the table of connectors -----------------------------------------------------------------------
# KVConnectorFactory.register_connector("MyConnector", "my_pkg.connector", "MyConnector"): entries are
# lazy ("pkg.mod:Class"), so registering imports nothing; kv_transfer/factory.py builds from it.

LOCAL_DISK = "LocalDiskConnector"


class _KVConnectorFactory(Registry[Any]):
    def __init__(self) -> None:
        super().__init__("kv_connectors", "KV connector")
        self.register(LOCAL_DISK, "asyncengine.kv_transfer.local_disk:LocalDiskConnector", owner=BUILT_IN)

    def register_connector(self, name: str, module_path: str, class_name: str, *, override: bool = False) -> None:
        """Register the class `class_name` of module `module_path` under `name` (vLLM's signature)."""
        for what, value in (("module_path", module_path), ("class_name", class_name)):
            if not isinstance(value, str) or not value or ":" in value:
                raise ConfigError(f"register_connector({name!r}, ...): {what} must be a non-empty name without "
                                  f"':' (register_connector('name', 'pkg.mod', 'Class')); got {value!r}")
        self.register(name, f"{module_path}:{class_name}", override=override)


KVConnectorFactory = _KVConnectorFactory()


__all__ = ["LOCAL_DISK", "KVConnectorBase", "KVConnectorContext", "KVConnectorFactory", "KVConnectorMetadata",
           "KVConnectorRequest", "KVConnectorRole"]
