"""The manifest: what the frontend loaded and registered, compared by every child at start-up.

A registry lives in one process. The frontend ships its manifest (plugins loaded, with versions, and
each registry's keys with who registered them) in the hand-shake; each engine-core and worker process
compares the registries its role reads and fails start-up when a key the frontend has is missing
there, naming the key, the registry, the process and the registrant. Extra keys in a child (ones its
platform registers there, say) are recorded with their origin.
"""

from __future__ import annotations

import time

from asyncengine.errors import MissingRegistration
from asyncengine.plugin_runtime.groups import PHASE_MANIFEST
from asyncengine.plugin_runtime.records import StartupTrace
from asyncengine.interfaces.tables import all_registries
# The Structs travel in the hand-shake, so they live on the wire; re-exported for the plugin phases.
from asyncengine.wire.startup import Manifest as Manifest
from asyncengine.wire.startup import PluginInfo as PluginInfo


def build_manifest(process: str, plugins: list[PluginInfo]) -> Manifest:
    return Manifest(
        process=process,
        plugins=plugins,
        registries={name: registry.owners() for name, (registry, _) in all_registries().items()},
    )


def check_manifest(frontend: Manifest, roles: set[str], trace: StartupTrace) -> None:
    """Compare the registries `roles` read with the frontend's; raise on the first missing key."""
    for name, (registry, readers) in all_registries().items():
        if not roles & readers:
            continue
        started = time.time()
        theirs = frontend.registries.get(name, {})
        ours = registry.owners()
        missing = [key for key in theirs if key not in ours]
        if missing:
            key = missing[0]
            others = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else ""
            trace.add(PHASE_MANIFEST, started=started, outcome="failed", plugin=f"registry:{name}",
                      reason=f"missing {', '.join(missing)}")
            raise MissingRegistration(
                f"{registry.what} {key!r} is missing from registry {name!r} here{others}, while "
                f"{frontend.process} has it (registered there by {theirs[key]}): a registration made in one "
                "process does not reach the others; register it from a general plugin (entry-point group "
                "asyncengine.general_plugins), which every process loads"
            )
        extra = {key: owner for key, owner in ours.items() if key not in theirs}
        detail = "same keys as the frontend" if not extra else "extra keys here: " + ", ".join(
            f"{key} (registered by {owner})" for key, owner in extra.items()
        )
        trace.add(PHASE_MANIFEST, started=started, plugin=f"registry:{name}", reason=detail)
