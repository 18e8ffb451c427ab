"""The Ray executor (`distributed_executor_backend="ray"`, the extra `asyncengine[ray]`): Ray places the
workers, our own transport connects them.

Ray's part: a placement group of one bundle per rank (`{"CPU": 1}`, plus `{"GPU": 1}` on CUDA), strategy
ASYNCENGINE_RAY_PLACEMENT_STRATEGY (PACK by default; SPREAD or STRICT_SPREAD put ranks on different nodes),
and in each bundle one `RankActor`, which starts our worker process (`python -m asyncengine.worker.process`,
the same as the mp executor's) on its node and reports how it ended. Ours: the worker connects back to the
engine core over TCP with the per-launch secret and speaks msgspec frames from then on; torch.distributed
meets at rank 0's node. Nothing of ours travels through Ray as a pickle: every actor call's arguments are
str or bytes (`invoke` checks it), answers are str.

The cluster: joined when one is given (`RAY_ADDRESS`, or `ray.init` already called by the application),
else a local one is started and shut down with the engine (with data parallelism in one process, the engine
cores share the connection: the last one shuts it down). A placement that is not ready within
ASYNCENGINE_RAY_PLACEMENT_TIMEOUT seconds (120) fails start-up saying what was asked. The worker process
watches its actor (die_with_parent): when the actor dies the worker exits, the connection closes, and
every request fails with an EngineDeadError naming the rank and its node. Shutdown kills the actors and
removes the placement group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from asyncengine.engine_core.executor import MultiprocExecutor
from asyncengine.engine_core.worker_processes import WorkerProcesses
from asyncengine.errors import ConfigError, StartupError
from asyncengine.runtime.connection import Listener, open_listener
from asyncengine.runtime.spawn import ENV_ADDRESS, ENV_RANK, ENV_SECRET, describe_exit
from asyncengine.wire.startup import NODE_ENV

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform
    from asyncengine.config.engine import EngineConfig

PLACEMENT_TIMEOUT_ENV = "ASYNCENGINE_RAY_PLACEMENT_TIMEOUT"
STRATEGY_ENV = "ASYNCENGINE_RAY_PLACEMENT_STRATEGY"
ACTOR_DIED = "its Ray actor died"


class _RayConnection:
    """This process's one Ray driver connection, shared by its engine cores (data parallelism in one
    process: each engine core's RayWorkers): joined or started by the first, shut down by the last to
    release it, and only if one of them started or joined it (never an application's own `ray.init`)."""

    users = 0
    ours = False
    lock = threading.Lock()  # acquire and release run in worker threads (one per engine core)

    @classmethod
    def acquire(cls) -> None:
        import ray

        with cls.lock:
            if not ray.is_initialized():
                ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
                cls.ours = True
            cls.users += 1

    @classmethod
    def release(cls) -> None:
        import ray

        with cls.lock:
            cls.users -= 1
            if cls.users == 0 and cls.ours:
                cls.ours = False
                ray.shutdown()


def invoke(method: Any, *args: str | bytes) -> Any:
    """`method.remote(*args)` for an actor method: only str and bytes cross to Ray (never our objects,
    which Ray would pickle)."""
    for index, arg in enumerate(args):
        if not isinstance(arg, (str, bytes)):
            raise TypeError(f"Ray actor call argument {index} is a {type(arg).__name__}: only str or bytes "
                            "travel through Ray (encode it as a msgspec frame)")
    return method.remote(*args)


class RankActor:
    """Runs in a Ray worker on the rank's node (made a Ray actor class by `_actor_class`)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def node(self) -> str:
        import ray

        context = ray.get_runtime_context()
        return json.dumps({"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()})

    def free_port(self) -> str:
        import socket

        with socket.socket() as probe:
            probe.bind(("", 0))
            return str(probe.getsockname()[1])

    def launch(self, address: str, secret: str, rank: str) -> str:
        """Start this node's worker process for `rank`; its pid. Its environment is this node's (so a
        plugin missing here is missing for it), plus where to connect."""
        import ray

        env = dict(os.environ)
        env.update({ENV_ADDRESS: address, ENV_SECRET: secret, ENV_RANK: rank})
        # Every start-up record of the rank says where it ran (the report and `plugins timeline --trace`).
        env[NODE_ENV] = f"Ray node {ray.util.get_node_ip_address()} {ray.get_runtime_context().get_node_id()}"
        source_root = str(Path(__file__).resolve().parents[2])  # where this node imports asyncengine from
        env["PYTHONPATH"] = os.pathsep.join([source_root, *filter(None, [env.get("PYTHONPATH")])])
        self.process = subprocess.Popen([sys.executable, "-m", "asyncengine.worker.process"],
                                        stdin=subprocess.DEVNULL, env=env)
        return str(self.process.pid)

    def wait(self) -> str:
        """Once the worker process has exited: its return code."""
        if self.process is None:
            return "-1"
        return str(self.process.wait())


class RayRank:
    """A rank's worker process as the executor watches it (the part of anyio's Process it uses)."""

    def __init__(self, actor: Any, pid: int, node: dict[str, str]) -> None:
        self.actor = actor
        self.pid = pid
        self.node = node
        self.returncode: int | None = None
        self.actor_died = False
        self._exit = invoke(actor.wait)
        self._done = anyio.Event()

    async def wait(self) -> int:
        if not self._done.is_set():
            await anyio.to_thread.run_sync(self._wait_blocking, abandon_on_cancel=True)
            self._done.set()
        return self.returncode if self.returncode is not None else -1

    def _wait_blocking(self) -> None:
        import ray

        try:
            self.returncode = int(ray.get(self._exit))
        except ray.exceptions.RayActorError:  # the actor (and so the worker process under it) is gone
            self.actor_died = True
            self.returncode = -9

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayWorkers(WorkerProcesses):
    """The ranks placed by Ray: one actor per rank in a placement group, each starting our worker process."""

    def __init__(self, engine_config: EngineConfig, platform: type[Platform]) -> None:
        super().__init__()
        self.engine_config = engine_config
        self.platform = platform
        self.placement_group: Any = None
        self.actors: list[Any] = []
        self.nodes: list[dict[str, str]] = []
        self._connected = False
        self._driver_ip = "127.0.0.1"

    def rank_name(self, rank: int) -> str:
        node = self.nodes[rank] if rank < len(self.nodes) else {"ip": "?", "node_id": "?"}
        pid = self.processes[rank].pid if rank < len(self.processes) else "?"
        return f"worker rank {rank} (pid {pid} on Ray node {node['ip']} {node['node_id'][:12]})"

    def describe_exit(self, rank: int) -> str:
        process = self.processes[rank]
        if isinstance(process, RayRank) and process.actor_died:
            return ACTOR_DIED
        return describe_exit(process.returncode)

    def _startup_failure(self, rank: int, error: BaseException) -> BaseException:
        # Say where: a plugin may be missing on that node only. (The same error, its message extended.)
        node = self.nodes[rank]
        error.args = (f"{error} [on Ray node {node['ip']} {node['node_id']}, worker rank {rank}]",)
        return error

    async def _open_listener(self) -> Listener:
        await anyio.to_thread.run_sync(self._place, self.engine_config.world_size)
        return await open_listener("tcp", host=self._driver_ip)

    async def _spawn(self, world_size: int, listener: Listener) -> None:
        await anyio.to_thread.run_sync(self._launch, world_size, listener.address, listener.secret)

    def _place(self, world_size: int) -> None:
        """In a thread: join or start the cluster, reserve the bundles, start one actor per bundle."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _RayConnection.acquire()
        self._connected = True
        self._driver_ip = ray.util.get_node_ip_address()
        gpus = 1 if self.platform.device_type == "cuda" else 0
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
        strategy = os.environ.get(STRATEGY_ENV, "PACK")
        timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout)
        if not ready:
            raise StartupError(
                f"Ray could not place {world_size} worker ranks ({bundle} each, strategy {strategy}) within "
                f"{timeout:g} s; the cluster has {ray.cluster_resources()}: add nodes or resources, or set "
                f"{STRATEGY_ENV} / {PLACEMENT_TIMEOUT_ENV}")
        actor_class = ray.remote(RankActor)
        launch = uuid.uuid4().hex[:12]  # actors are named per launch: `ray list actors` shows whose they are
        for rank in range(world_size):
            self.actors.append(actor_class.options(
                name=f"asyncengine:{launch}:rank{rank}", num_cpus=1, num_gpus=gpus, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank),
            ).remote())
        self.nodes = [json.loads(answer) for answer in ray.get([invoke(actor.node) for actor in self.actors])]
        if world_size > 1:  # torch.distributed meets at rank 0, on its node
            port = ray.get(invoke(self.actors[0].free_port))
            self.rendezvous = f"tcp://{self.nodes[0]['ip']}:{port}"

    def _launch(self, world_size: int, address: str, secret: str) -> None:
        import ray

        pids = ray.get([invoke(actor.launch, address, secret, str(rank)) for rank, actor in enumerate(self.actors)])
        # RayRank has the part of anyio's Process that the executor and `stop` use.
        self.processes = [RayRank(actor, int(pid), node)  # type: ignore[misc]
                          for actor, pid, node in zip(self.actors, pids, self.nodes)]

    async def stop(self, *, grace_period: float) -> None:
        try:
            await super().stop(grace_period=grace_period)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._release)

    def _release(self) -> None:
        """Kill every actor, remove the placement group, and let go of the Ray connection (the last engine
        core of this process to let go of one it started or joined shuts it down)."""
        import ray

        if not self._connected:
            return
        self._connected = False
        try:
            if ray.is_initialized():
                for actor in self.actors:
                    ray.kill(actor, no_restart=True)
                if self.placement_group is not None:
                    ray.util.remove_placement_group(self.placement_group)
            self.actors, self.placement_group = [], None
        finally:
            _RayConnection.release()


class RayExecutor(MultiprocExecutor):
    """The mp executor's protocol over ranks that Ray placed (RayWorkers)."""

    def _new_workers(self) -> WorkerProcesses:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'asyncengine[ray]'",
                              field="distributed_executor_backend") from exc
        return RayWorkers(self.engine_config, self.platform)


__all__ = ["RankActor", "RayExecutor", "RayWorkers", "invoke"]
