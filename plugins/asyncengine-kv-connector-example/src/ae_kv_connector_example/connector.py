"""ExampleDiskConnector: the built-in LocalDiskConnector's protocol with a layout of its own, recording
where each method ran.

Layout: DIR/example-blocks/<key[:2]>/<key>.rank<rank>-of-<size>.safetensors (a fan-out that keeps
directories small when millions of blocks are saved), and DIR/example-blocks/identity.rank<rank>-of-<size>.json.

With the environment variable AE_PLUGIN_RECORD naming a file, each method appends one JSON line the first
time it runs in a process: {"plugin", "event", "side", "class", "pid", "role", ...}. The scheduler side's
lines must name the engine core, the worker side's a worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from asyncengine.plugins_api import LocalDiskConnector, current_process_role

RECORD_ENV = "AE_PLUGIN_RECORD"


def record(event: str, **fields: Any) -> dict[str, Any]:
    """Append one JSON line to $AE_PLUGIN_RECORD (if set): where this code runs, and `fields`."""
    line = {"plugin": "ae_kv_connector_example", "event": event, "pid": os.getpid(),
            "role": current_process_role(), "time": time.time(), **fields}
    path = os.environ.get(RECORD_ENV)
    if path:
        # One write of one line in append mode: lines from several processes do not interleave.
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")
    return line


class ExampleDiskConnector(LocalDiskConnector):
    variant = "registry"  # which of the plugin's two classes this is (via_module_path says "module path")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorded: set[str] = set()
        self.calls: dict[str, int] = {}
        self._note("init")

    def _note(self, event: str, **fields: Any) -> None:
        self.calls[event] = self.calls.get(event, 0) + 1
        if event not in self._recorded:
            self._recorded.add(event)
            record(event, side=self.role.value, variant=self.variant, kv_role=self.config.kv_role,
                   cls=f"{type(self).__module__}:{type(self).__qualname__}", **fields)

    def describe(self) -> str:
        return f"example layout under {self.root}"

    @property
    def root(self) -> Path:
        return self.path / "example-blocks"

    # -- its own layout --------------------------------------------------------------------------------

    def block_file(self, key: str, rank: int) -> Path:
        return self.root / key[:2] / f"{key}.rank{rank}-of-{self.world_size}.safetensors"

    def identity_file(self, rank: int) -> Path:
        return self.root / f"identity.rank{rank}-of-{self.world_size}.json"

    # -- scheduler side (engine core) ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._note("get_num_new_matched_tokens", num_tokens=found)
        return found

    def update_state_after_alloc(self, request, num_external_tokens):
        self._note("update_state_after_alloc", num_external_tokens=num_external_tokens)
        return super().update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, requests):
        metadata = super().build_connector_meta(requests)
        if metadata is not None:
            self._note("build_connector_meta", loads=len(metadata.loads), saves=len(metadata.saves))
        return metadata

    def request_finished(self, request):
        self._note("request_finished")
        return super().request_finished(request)

    # -- worker side (each worker rank) --------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._note("register_kv_caches", num_layers=len(kv_caches))
        return super().register_kv_caches(kv_caches)

    def start_load_kv(self, metadata):
        super().start_load_kv(metadata)
        if metadata.loads:
            self._note("start_load_kv", blocks=len(metadata.loads))

    def wait_for_save(self, metadata):
        before = self.num_blocks_saved
        super().wait_for_save(metadata)
        if self.num_blocks_saved > before:
            self._note("wait_for_save", blocks=self.num_blocks_saved - before)
