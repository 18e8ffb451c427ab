"""`asyncengine plugins map`: where each extension point is read, one column per process.

Three kinds, as docs/reference.md names them, and they reach a process differently:
- an entry-point group is loaded by the process itself at start-up (it needs nothing from you);
- a config hook reaches the process in the configuration every process receives;
- a registry works in a process only if a general plugin (or the platform) filled it there.
Each entry names the code that reads it (`path:line`), taken from the code itself: the groups' loaders,
the functions marked `@reads(registry, role)`, and the config-hook table. Nothing here is typed twice.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncengine.plugin_runtime import groups as g

PROCESSES = (g.FRONTEND, g.ENGINE_CORE, g.WORKER)
ENTRY_POINT, CONFIG_HOOK, REGISTRY = "entry point", "config hook", "registry"
PLURAL = {ENTRY_POINT: "entry-point groups", CONFIG_HOOK: "config hooks", REGISTRY: "registries"}
HOW = {
    ENTRY_POINT: "found and loaded by the process itself",
    CONFIG_HOOK: "arrives in the configuration",
    REGISTRY: "works only if a general plugin filled it in this process",
}


@dataclass(frozen=True)
class MapEntry:
    process: str
    kind: str
    name: str
    location: str  # path:line of the code that reads it there


def location_of(function: Any) -> str:
    function = inspect.unwrap(function)
    parts = Path(inspect.getsourcefile(function) or "?").parts
    start = max(i for i, part in enumerate(parts) if part == "asyncengine") if "asyncengine" in parts else 0
    return f"{'/'.join(parts[start:])}:{inspect.getsourcelines(function)[1]}"


def _group_loader(group: g.Group) -> Any:
    """The function that loads `group` in a process."""
    if group is g.PLATFORM:
        from asyncengine.plugin_runtime.platform_resolution import resolve_platform

        return resolve_platform
    from asyncengine.plugin_runtime.phases import run_plugin_phases

    return run_plugin_phases


def build_map() -> list[MapEntry]:
    from asyncengine.plugin_runtime.config_hooks import HOOK_READERS, load_hook
    from asyncengine.interfaces.tables import READER_MODULES, all_registries
    from asyncengine.interfaces.registry import recorded_read_sites

    entries = []
    for group in g.GROUPS:
        for process in PROCESSES:
            if process in group.roles:
                entries.append(MapEntry(process, ENTRY_POINT, group.entry_point_group, location_of(_group_loader(group))))
    for module in READER_MODULES:
        importlib.import_module(module)
    sites = recorded_read_sites()
    for option, readers in HOOK_READERS.items():
        for process in PROCESSES:
            if process in readers:
                # The function that uses the hook there, when it is marked; else the generic loader.
                marked = [s.location for s in sites if s.registry == f"hook:{option}" and s.role == process]
                for location in marked or [location_of(load_hook)]:
                    entries.append(MapEntry(process, CONFIG_HOOK, option, location))
    registries = all_registries()
    for site in sites:
        if site.registry in registries:
            entries.append(MapEntry(site.role, REGISTRY, site.registry, site.location))
    order = {process: index for index, process in enumerate(PROCESSES)}
    kinds = {ENTRY_POINT: 0, CONFIG_HOOK: 1, REGISTRY: 2}
    # The location last: one registry read in two places of a process keeps one order whatever imported first.
    return sorted(entries, key=lambda e: (order[e.process], kinds[e.kind], e.name, e.location))


def format_map(entries: list[MapEntry]) -> str:
    lines = []
    for process in PROCESSES:
        lines.append(f"{process}")
        for kind in (ENTRY_POINT, CONFIG_HOOK, REGISTRY):
            mine = [e for e in entries if e.process == process and e.kind == kind]
            if not mine:
                continue
            lines.append(f"  {PLURAL[kind]} ({HOW[kind]}):")
            lines.extend(f"    {e.name:<36} {e.location}" for e in mine)
    return "\n".join(lines)


# The row of docs/reference.md (docs/reference.md's ids) for each name the map shows, so that the
# generated page links every entry to its row; a name without a row is shown without a link.
REFERENCE_ROWS = {
    "asyncengine.general_plugins": "E1", "asyncengine.platform_plugins": "E2",
    "asyncengine.io_processor_plugins": "E3", "asyncengine.stat_logger_plugins": "E4",
    "asyncengine.endpoint_plugins": "E5", "asyncengine.logits_processors": "E6",
    "models": "R1", "custom_ops": "R2", "op_providers": "R2", "attention_backends": "R3", "quantization": "R4",
    "model_loaders": "R5", "kv_connectors": "R6", "tool_parsers": "R7", "reasoning_parsers": "R8",
    "tokenizers": "R9", "structured_output_backends": "R10", "structured_outputs_config": "R10",
    "lora_resolvers": "R11", "poolers": "R12", "proposers": "R13", "multimodal_processors": "R14",
    "scheduler_cls": "C1", "worker_cls": "C2", "worker_extension_cls": "C3", "logits_processors": "C4",
    "model_class_overrides": "C5", "kv_connector_module_path": "C6", "kv_transfer_config": "R6",
    "distributed_executor_backend": "C7", "middleware": "C8", "additional_config": "C9", "hf_overrides": "C9",
}


def _row_link(name: str) -> str:
    row = REFERENCE_ROWS.get(name)
    return f" [{row}](reference.md#{row.lower()})" if row else ""


def format_map_markdown(entries: list[MapEntry]) -> str:
    """The same picture as a table with one column per process (for docs/), each entry linked to its row
    of the reference."""
    cells = {}
    for process in PROCESSES:
        cells[process] = [f"{_badge(e.kind)} `{e.name}`{_row_link(e.name)} ({e.location})"
                          for e in entries if e.process == process]
    rows = max(len(column) for column in cells.values())
    lines = ["| " + " | ".join(PROCESSES) + " |", "|" + "---|" * len(PROCESSES)]
    for index in range(rows):
        lines.append("| " + " | ".join(cells[p][index] if index < len(cells[p]) else "" for p in PROCESSES) + " |")
    legend = "; ".join(f"{_badge(kind)} {kind}: {HOW[kind]}" for kind in (ENTRY_POINT, CONFIG_HOOK, REGISTRY))
    return "\n".join(lines) + f"\n\n{legend}."


def _badge(kind: str) -> str:
    return {ENTRY_POINT: "[E]", CONFIG_HOOK: "[C]", REGISTRY: "[R]"}[kind]


DOCS_PAGE_HEADER = """# Where each extension point is read

Generated by `asyncengine plugins map --write docs/extension-map.md`; a test checks that this page is
what the command prints today, so after code moves, run it again. Each entry links to its row of the
[reference](reference.md).

---

"""


def docs_page(entries: list[MapEntry]) -> str:
    return DOCS_PAGE_HEADER + format_map_markdown(entries) + "\n"
