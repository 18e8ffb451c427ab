"""What a process reports about its start-up, as it travels: the records of its phases, and the frontend's
manifest (plugins loaded, registry keys and who registered each) that every child compares.

The plugin runtime fills them (asyncengine/plugin_runtime/records.py traces the phases,
manifest.py builds and checks the manifest); the hand-shake (messages.py) carries them, so they live
here, below both.
"""

from __future__ import annotations

import os

import msgspec

NODE_ENV = "ASYNCENGINE_NODE"
_THIS_NODE = os.environ.get(NODE_ENV) or None


class StartupRecord(msgspec.Struct, kw_only=True):
    pid: int
    role: str  # "frontend", "engine core", "worker rank 0", ...
    phase: str
    group: str | None = None  # entry-point group of a plugin record
    plugin: str | None = None  # plugin (entry point) name, or what else the record is about
    distribution: str | None = None
    version: str | None = None
    outcome: str = "ok"  # "ok", "skipped" or "failed" (records.OK, SKIPPED, FAILED)
    reason: str | None = None  # why skipped, the traceback of a failure, or a detail
    start: float = 0.0  # time.time()
    duration: float = 0.0  # seconds
    import_duration: float = 0.0  # of a loaded plugin: the seconds of `duration` spent importing its module
    # Where the process ran when a cluster manager placed it ("Ray node <ip> <node id>", from NODE_ENV,
    # which the Ray executor sets for each rank's worker process); None: where its parent runs.
    node: str | None = msgspec.field(default_factory=lambda: _THIS_NODE)


class PluginInfo(msgspec.Struct, kw_only=True):
    group: str
    name: str
    distribution: str | None = None
    version: str | None = None


class Manifest(msgspec.Struct, kw_only=True):
    process: str
    plugins: list[PluginInfo] = msgspec.field(default_factory=list)
    registries: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)  # registry -> key -> owner


__all__ = ["Manifest", "PluginInfo", "StartupRecord"]
