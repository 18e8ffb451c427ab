"""The rules of the start-up plan as data: one source for `asyncengine plugins timeline` (Python,
timeline.py) and the interactive page docs/startup-timeline.md (JavaScript, docs/assets/startup-timeline.js).

Both read the same structure and apply it the same way, so the page cannot tell a reader something the
CLI would not. The structure is drawn from the tables the real start uses (groups.py, the registries,
the config hooks, the allow-list's messages); what cannot be drawn from a table (the phases after the
plugin phases, where each process runs) is written here once, as templates.

A template is a string with `{tp}`, `{rank}` or `{device}` in it, or `{"when": [CONDITION...], "text": ...}`,
kept when every condition holds. The conditions are the five in CONDITIONS; a setting (in-process or not,
tensor-parallel size, the executor backend) decides which hold. `asyncengine plugins timeline
--export-rules FILE` writes the JSON; docs/assets/startup-timeline-rules.json is that file, checked by a test.
"""

from __future__ import annotations

import json
from typing import Any

from asyncengine.interfaces.roles import ROLES as ROLE_NAMES
from asyncengine.plugin_runtime import allow_list as al
from asyncengine.plugin_runtime import groups as g

RULES_FORMAT = 1
ROLES = ROLE_NAMES  # the process roles, in the order the plan shows them

# What a condition means; `holds` in timeline.py and in the page's script decide each from the setting.
CONDITIONS = {
    "in_process": "the engine core runs in the frontend's process (--in-process)",
    "multiprocess": "the engine core runs in a process of its own (the default of `serve` and `plugins timeline`)",
    "uni": "the worker runs on a thread of the engine core's process (executor backend 'uni': the default "
           "for tensor_parallel_size 1)",
    "mp": "one worker process per rank (executor backend 'mp': the default for tensor_parallel_size > 1)",
    "several_ranks": "tensor_parallel_size > 1",
}

# Which executor backend a setting gets when distributed_executor_backend is not set
# (EngineConfig.executor_backend; a test checks the two agree).
DEFAULT_BACKEND = {"one_rank": "uni", "several_ranks": "mp"}

# The processes of a start, in the order the plan lists them. `plays`: the roles the process plays (a role
# decides which plugin groups, config hooks and registries it sees). `plugin_phases`: when the process runs
# the five plugin phases of its own, and whether it is the one that chooses the platform. `phases`: the
# phases after those, each with its details and the Platform hooks it calls ("worker: " when the worker,
# on a thread or in its own process, calls them on behalf of this phase).
PROCESSES: list[dict[str, Any]] = [
    {
        "role": "frontend",
        "when": [],
        "per_rank": False,
        "where": ["the calling process"],
        "plays": [g.FRONTEND, {"when": ["in_process"], "role": g.ENGINE_CORE},
                  {"when": ["in_process", "uni"], "role": g.WORKER}],
        "plugin_phases": {"when": [], "chooses_platform": True},
        "phases": [
            {"name": "model", "details": ["find the model (convert a GGUF file once)", "tokenizer",
                                          "model description"], "platform_hooks": []},
            {"name": "engine core",
             "details": [{"when": ["in_process"], "text": "in this process"},
                         {"when": ["multiprocess"], "text": "spawn the engine-core process, send it the config, "
                                                            "the platform and the manifest; wait for Ready"}],
             "platform_hooks": []},
            {"name": "ready", "details": ["platform hook per request: validate_request"],
             "platform_hooks": ["validate_request"]},
        ],
    },
    {
        "role": "engine core",
        "when": [],
        "per_rank": False,
        "where": [{"when": ["in_process"], "text": "the frontend's process"},
                  {"when": ["multiprocess"], "text": "its own process"}],
        "plays": [g.ENGINE_CORE, {"when": ["uni"], "role": g.WORKER}],
        "plugin_phases": {"when": ["multiprocess"], "chooses_platform": False},
        "phases": [
            {"name": "start workers",
             "details": [{"when": ["mp"], "text": "{tp} worker process(es)"},
                         {"when": ["uni"], "text": "the worker on a thread of this process: platform hooks "
                                                   "set_device, seed_everything"}],
             "platform_hooks": [{"when": ["uni"], "text": "worker: set_device"},
                                {"when": ["uni"], "text": "worker: seed_everything"}]},
            {"name": "load model",
             "details": ["worker: get_attn_backend_cls (or attention_backend), resolved in the attention_backends "
                         "registry; the choice per layer is recorded",
                         "worker: op_priority (the config's, else the platform's) orders the op providers; "
                         "each op's provider and each out-of-tree custom op are recorded"],
             "platform_hooks": ["worker: get_attn_backend_cls", "worker: op_priority"]},
            {"name": "kv cache",
             "details": ["worker: a multimodal model's vision encoder runs on the dummy inputs of its "
                         "multimodal_processors registration first (recorded as `multimodal profile`)",
                         "worker: get_device_total_memory, get_current_memory_usage (not on cpu)"],
             "platform_hooks": ["worker: get_device_total_memory (not on cpu)",
                                "worker: get_current_memory_usage (not on cpu)"]},
            {"name": "ready", "details": [], "platform_hooks": []},
        ],
    },
    {
        "role": "worker rank {rank}",
        "when": ["mp"],
        "per_rank": True,
        "where": ["its own process"],
        "plays": [g.WORKER],
        "plugin_phases": {"when": [], "chooses_platform": False},
        "phases": [
            {"name": "init device",
             "details": ["platform hooks: set_device, seed_everything",
                         {"when": ["several_ranks"], "text": "join the process group ({tp} ranks)"}],
             "platform_hooks": ["set_device", "seed_everything"]},
            {"name": "ready", "details": [], "platform_hooks": []},
        ],
    },
]

# The wording of the five plugin phases' details ({...}: filled in by the plan).
PLUGIN_PHASE_TEXTS = {
    "device_chosen": "--device {device}",  # a device other than "auto": no detector runs
    "detector": "detector {plugin}",  # device "auto": each installed platform plugin's detector, in order
    "builtin_detectors": "built-in detector cuda, else cpu",
    "chooses_platform_hook": "platform hook: check_and_update_config",
    "chooses_platform_hooks": ["check_and_update_config"],
    "platform_from_frontend": "the platform the frontend chose",
    "none_installed": "none installed",
    "role_group": "{group}: {plugins}",
    "no_role_group": "no group loads in this process",
    "config_hook": "{option}={path} (import; {checks})",
    "no_config_hook": "no module:attr option set",
    "registries": "registries: {registries}",
    "no_registries": "none read here",
    "registry_subject": "registry:{registry}",
    "skipped": "{plugin} (skipped: {reason})",
    "list_separator": ", ",
}


def timeline_rules() -> dict[str, Any]:
    """The rules, as plain data (what --export-rules writes)."""
    from asyncengine.plugin_runtime.config_hooks import HOOKS
    from asyncengine.interfaces.tables import all_registries

    def ordered(roles) -> list[str]:
        return [role for role in ROLES if role in roles]

    return {
        "format": RULES_FORMAT,
        "about": "The rules of `asyncengine plugins timeline`, written by `asyncengine plugins timeline "
                 "--export-rules FILE`; docs/startup-timeline.md computes its plan from them.",
        "roles": list(ROLES),
        "conditions": CONDITIONS,
        "default_backend": DEFAULT_BACKEND,
        # Installed plugins are listed (and loaded) by group in this order, then by entry-point name.
        "groups": [{"key": group.key, "entry_point_group": group.entry_point_group, "roles": ordered(group.roles),
                    "phase": group.phase, "opt_in": group.opt_in, "value": group.value} for group in g.GROUPS],
        "plugin_phases": [g.PHASE_PLATFORM, g.PHASE_GENERAL, g.PHASE_ROLE_GROUPS, g.PHASE_CONFIG_HOOKS,
                          g.PHASE_MANIFEST],
        "role_group_order": [group.key for group in (g.IO_PROCESSOR, g.STAT_LOGGER, g.ENDPOINT, g.LOGITS_PROCESSOR)],
        "platform_group": g.PLATFORM.key,
        "general_group": g.GENERAL.key,
        "allow_list": {
            "option": al.OPTION_SOURCE,
            "environment_variable": al.ENV_VAR,
            "unset": "every installed plugin loads, except those of opt-in groups",
            "parse": "split at commas; each name trimmed; empty names dropped (the empty string allows none)",
            "opt_in_reason": al.OPT_IN_REASON,
            "not_named_reason": al.NOT_NAMED_REASON,
            "unknown_names_error": al.UNKNOWN_NAMES_ERROR,
            "installed_plugin": al.INSTALLED_PLUGIN,
            "no_plugin_installed": al.NONE_INSTALLED,
            "cli_error": "asyncengine: configuration error: {message}",  # and exit status 2
        },
        "registries": {name: ordered(readers) for name, (_, readers) in all_registries().items()},
        "config_hooks": {option: {"readers": ordered(hook.readers), "checks": hook.checks}
                         for option, hook in HOOKS.items()},
        "texts": PLUGIN_PHASE_TEXTS,
        "processes": PROCESSES,
    }


def rules_json() -> str:
    return json.dumps(timeline_rules(), indent=1) + "\n"
