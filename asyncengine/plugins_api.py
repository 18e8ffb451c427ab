"""Everything a plugin may import from asyncengine: the extension interfaces and register functions.

Plugins import only this module (first-party ones under plugins/ included). Names follow vLLM's, so a
vLLM plugin ports by renaming imports. Each entry says which process reads it: a registry filled in
one process is invisible to the others, so register from a general plugin (entry-point group
`asyncengine.general_plugins`), which every process loads; the start-up manifest check names any key
the frontend has and a child lacks.
"""

from __future__ import annotations

from asyncengine.frontend.endpoints import EndpointPlugin  # read in: frontend (opt-in)
from asyncengine.frontend.io_processor import IOProcessor  # read in: frontend
from asyncengine.frontend.stat_loggers import StatLoggerBase  # read in: frontend
from asyncengine.models.registry import ModelRegistry  # read in: frontend (validate), worker (build)
from asyncengine.platforms.interface import Platform  # read in: every process
from asyncengine.platforms.resolution import current_platform  # every process, after its platform phase
from asyncengine.plugin_runtime.records import current_process_role  # every process: where this code runs
from asyncengine.registries.base import Registry, RegistrationError  # the registry type itself
from asyncengine.server.parsers import (  # read in: frontend (the chat completions route)
    DeltaMessage,
    ExtractedToolCalls,
    ReasoningParser,
    ReasoningParserManager,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from asyncengine.worker.logits_processors import LogitsProcessor  # read in: worker (build), frontend (validate)

__all__ = [
    "EndpointPlugin",
    "IOProcessor",
    "LogitsProcessor",
    "ModelRegistry",
    "Platform",
    "Registry",
    "RegistrationError",
    "StatLoggerBase",
    "current_platform",
    "current_process_role",
    "DeltaMessage",
    "ExtractedToolCalls",
    "ReasoningParser",
    "ReasoningParserManager",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
]
