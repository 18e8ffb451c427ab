"""The start-up plan: per process, its phases in order and what runs in each, without starting anything.

It answers "which process sees which plugin" before a start: `asyncengine plugins timeline`. The plan
is the rules of timeline_rules.py (which processes a setting has, which roles each plays, the phases
and their wording) applied to the config and the installed plugins; the page docs/startup-timeline.md
applies the same rules in JavaScript. The rules come from the tables the real start uses (groups.py,
config_hooks.py, the registries), and a test compares the plan, process by process and phase by phase,
with the trace of a real start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncengine.config.engine import EngineConfig
from asyncengine.plugin_runtime.allow_list import AllowList
from asyncengine.plugin_runtime.config_hooks import hooks_checked
from asyncengine.plugin_runtime.discovery import InstalledPlugin, installed_plugins
from asyncengine.plugin_runtime.placement import MP, UNI, worker_placement
from asyncengine.cli.reports.timeline_rules import timeline_rules


@dataclass
class PhasePlan:
    name: str
    details: list[str] = field(default_factory=list)
    # What the trace of a real start holds a record of in this phase: each plugin by its entry-point
    # name (loaded or skipped), and "registry:NAME" for each registry the manifest check compares.
    subjects: list[str] = field(default_factory=list)
    # The Platform hooks this phase calls ("worker: NAME" when the worker calls them for this phase).
    platform_hooks: list[str] = field(default_factory=list)


@dataclass
class ProcessPlan:
    role: str  # as in the trace: "frontend", "engine core", "worker rank 0", ...
    where: str  # "its own process", or which process it shares
    phases: list[PhasePlan] = field(default_factory=list)
    plays: list[str] = field(default_factory=list)  # the roles it plays: frontend, engine core, worker


def settings_facts(config: EngineConfig) -> dict[str, bool]:
    """Which of the rules' conditions hold for `config`."""
    backend = worker_placement(config)  # UNI or MP (a pkg.mod:Executor where its class puts its workers)
    return {"in_process": config.in_process, "multiprocess": not config.in_process, "uni": backend == UNI,
            "mp": backend == MP, "several_ranks": config.tensor_parallel_size > 1}


def plan_start(config: EngineConfig) -> list[ProcessPlan]:
    rules = timeline_rules()
    installed = installed_plugins()
    allow_list = AllowList.resolve(config.plugins)
    allow_list.check(installed)
    facts = settings_facts(config)
    values = {"tp": config.tensor_parallel_size, "device": config.device}

    def holds(conditions: list[str]) -> bool:
        return all(facts[condition] for condition in conditions)

    def kept(templates: list[Any], key: str = "text", **more: Any) -> list[str]:
        """Each template whose conditions hold, filled in."""
        return [(t if isinstance(t, str) else t[key]).format(**values, **more) for t in templates
                if isinstance(t, str) or holds(t["when"])]

    plans = []
    for process in rules["processes"]:
        if not holds(process["when"]):
            continue
        for rank in range(config.tensor_parallel_size) if process["per_rank"] else [None]:
            plays = kept(process["plays"], key="role")
            plan = ProcessPlan(process["role"].format(rank=rank), kept(process["where"])[0], plays=plays)
            if holds(process["plugin_phases"]["when"]):
                plan.phases = _plugin_phases(rules, set(plays), config, installed, allow_list,
                                             chooses_platform=process["plugin_phases"]["chooses_platform"])
            plan.phases += [PhasePlan(phase["name"], kept(phase["details"]),
                                      platform_hooks=kept(phase["platform_hooks"])) for phase in process["phases"]]
            plans.append(plan)
    return plans


def _plugin_phases(rules: dict[str, Any], roles: set[str], config: EngineConfig, installed: list[InstalledPlugin],
                   allow_list: AllowList, *, chooses_platform: bool) -> list[PhasePlan]:
    texts = rules["texts"]
    join = texts["list_separator"].join
    groups = {group["key"]: group for group in rules["groups"]}

    def seen(*keys: str) -> list[InstalledPlugin]:
        """The installed plugins of these groups that a process playing `roles` loads (or skips)."""
        return [plugin for plugin in installed
                if plugin.group.key in keys and roles & set(groups[plugin.group.key]["roles"])]

    def names(key: str) -> list[str]:
        listed = []
        for plugin in seen(key):
            verdict = allow_list.verdict(plugin)
            listed.append(plugin.name if verdict is None
                          else texts["skipped"].format(plugin=plugin.name, reason=verdict))
        return listed

    platform_group, general_group = rules["platform_group"], rules["general_group"]
    hooks: list[str] = []
    if chooses_platform:
        platform = ([texts["device_chosen"].format(device=config.device)] if config.device != "auto"
                    else [texts["detector"].format(plugin=n) for n in names(platform_group)]
                    + [texts["builtin_detectors"]])
        platform.append(texts["chooses_platform_hook"])
        hooks = list(texts["chooses_platform_hooks"])
    else:
        platform = [texts["platform_from_frontend"]]
    role_groups = [texts["role_group"].format(group=key, plugins=join(names(key)) or texts["none_installed"])
                   for key in rules["role_group_order"] if roles & set(groups[key]["roles"])]
    # The same selection as the real phase (config_hooks.hooks_checked): the frontend checks every hook
    # set, the other processes the hooks their roles read.
    config_hooks = [texts["config_hook"].format(option=option, path=path,
                                                checks=rules["config_hooks"][option.split("[")[0]]["checks"])
                    for option, path in hooks_checked(config, roles)]
    phase_names = rules["plugin_phases"]  # platform, general plugins, role groups, config hooks, manifest check
    phases = [
        PhasePlan(phase_names[0], platform, [p.name for p in seen(platform_group)], hooks),
        PhasePlan(phase_names[1], names(general_group) or [texts["none_installed"]],
                  [p.name for p in seen(general_group)]),
        PhasePlan(phase_names[2], role_groups or [texts["no_role_group"]],
                  [p.name for p in seen(*rules["role_group_order"])]),
        PhasePlan(phase_names[3], config_hooks or [texts["no_config_hook"]]),
    ]
    if not chooses_platform:
        registries = [name for name, readers in rules["registries"].items() if roles & set(readers)]
        phases.append(PhasePlan(phase_names[4],
                                [texts["registries"].format(registries=join(registries) or texts["no_registries"])],
                                [texts["registry_subject"].format(registry=name) for name in registries]))
    return phases


def format_plan(plans: list[ProcessPlan]) -> str:
    lines = []
    for plan in plans:
        lines.append(f"{plan.role} ({plan.where})")
        for index, phase in enumerate(plan.phases, 1):
            lines.append(f"  {index}. {phase.name}")
            lines.extend(f"       {detail}" for detail in phase.details)
    return "\n".join(lines)
