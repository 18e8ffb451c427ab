"""The start-up plan: per process, its phases in order and what runs in each, without starting anything.

It answers "which process sees which plugin" before a start: `asyncengine plugins timeline`. It is
built from the same tables as the real start (groups.py, config_hooks.py, the registries), and a test
compares it, process by process and phase by phase, with the trace of a real start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.config.engine import EngineConfig
from asyncengine.plugin_runtime import groups as g
from asyncengine.plugin_runtime.allow_list import AllowList
from asyncengine.plugin_runtime.config_hooks import HOOKS, hooks_checked
from asyncengine.plugin_runtime.discovery import InstalledPlugin, installed_plugins
from asyncengine.plugin_runtime.phases import frontend_roles
from asyncengine.registries import all_registries


@dataclass
class PhasePlan:
    name: str
    details: list[str] = field(default_factory=list)
    # What the trace of a real start holds a record of in this phase: each plugin by its entry-point
    # name (loaded or skipped), and "registry:NAME" for each registry the manifest check compares.
    subjects: list[str] = field(default_factory=list)


@dataclass
class ProcessPlan:
    role: str  # as in the trace: "frontend", "engine core", "worker rank 0", ...
    where: str  # "its own process", or which process it shares
    phases: list[PhasePlan] = field(default_factory=list)


def plan_start(config: EngineConfig) -> list[ProcessPlan]:
    installed = installed_plugins()
    allow_list = AllowList.resolve(config.plugins)
    allow_list.check(installed)
    from asyncengine.engine_core.executor import worker_placement

    backend = worker_placement(config)  # "uni" or "mp" (a pkg.mod:Executor as the built-in it subclasses)
    plans = []
    roles = frontend_roles(config)
    frontend = ProcessPlan("frontend", "the calling process")
    frontend.phases = _plugin_phases(roles, config, installed, allow_list, chooses_platform=True)
    frontend.phases += [
        PhasePlan("model", ["find the model (convert a GGUF file once)", "tokenizer", "model description"]),
        PhasePlan("engine core", ["in this process" if config.in_process else "spawn the engine-core process, "
                                  "send it the config, the platform and the manifest; wait for Ready"]),
        PhasePlan("ready", ["platform hook per request: validate_request"]),
    ]
    plans.append(frontend)

    core = ProcessPlan("engine core", "the frontend's process" if config.in_process else "its own process")
    if not config.in_process:
        core_roles = {g.ENGINE_CORE} | ({g.WORKER} if backend == "uni" else set())
        core.phases = _plugin_phases(core_roles, config, installed, allow_list, chooses_platform=False)
    workers = (f"{config.tensor_parallel_size} worker process(es)" if backend == "mp"
               else "the worker on a thread of this process: platform hooks set_device, seed_everything")
    core.phases += [
        PhasePlan("start workers", [workers]),
        PhasePlan("load model", ["worker: get_attn_backend_cls (or attention_backend), resolved in the "
                                 "attention_backends registry; the choice per layer is recorded",
                                 "worker: op_priority (the config's, else the platform's) orders the op providers; "
                                 "each op's provider and each out-of-tree custom op are recorded"]),
        PhasePlan("kv cache", ["worker: get_device_total_memory, get_current_memory_usage (not on cpu)"]),
        PhasePlan("ready", []),
    ]
    plans.append(core)

    if backend == "mp":
        for rank in range(config.tensor_parallel_size):
            worker = ProcessPlan(f"worker rank {rank}", "its own process")
            worker.phases = _plugin_phases({g.WORKER}, config, installed, allow_list, chooses_platform=False)
            worker.phases += [
                PhasePlan("init device", ["platform hooks: set_device, seed_everything"]
                          + ([f"join the process group ({config.tensor_parallel_size} ranks)"]
                             if config.tensor_parallel_size > 1 else [])),
                PhasePlan("ready", []),
            ]
            plans.append(worker)
    return plans


def _plugin_phases(roles: set[str], config: EngineConfig, installed: list[InstalledPlugin], allow_list: AllowList,
                   *, chooses_platform: bool) -> list[PhasePlan]:
    def names(group: g.Group) -> list[str]:
        listed = []
        for plugin in installed:
            if plugin.group is group and roles & group.roles:
                verdict = allow_list.verdict(plugin)
                listed.append(plugin.name + ("" if verdict is None else f" (skipped: {verdict})"))
        return listed

    if chooses_platform:
        platform = ([f"--device {config.device}"] if config.device != "auto"
                    else [f"detector {n}" for n in names(g.PLATFORM)] + ["built-in detector cuda, else cpu"])
        platform.append("platform hook: check_and_update_config")
    else:
        platform = ["the platform the frontend chose"]
    role_groups = [f"{group.key}: {', '.join(names(group)) or 'none installed'}"
                   for group in (g.IO_PROCESSOR, g.STAT_LOGGER, g.ENDPOINT, g.LOGITS_PROCESSOR) if roles & group.roles]
    # The same selection as the real phase (config_hooks.hooks_checked): the frontend checks every hook
    # set, the other processes the hooks their roles read (HOOK_READERS).
    hooks = [f"{option}={path} (import; {HOOKS[option.split('[')[0]].checks})"
             for option, path in hooks_checked(config, roles)]
    def subjects(*groups: g.Group) -> list[str]:
        return [plugin.name for plugin in installed if plugin.group in groups and roles & plugin.group.roles]

    phases = [
        PhasePlan(g.PHASE_PLATFORM, platform, subjects(g.PLATFORM)),
        PhasePlan(g.PHASE_GENERAL, names(g.GENERAL) or ["none installed"], subjects(g.GENERAL)),
        PhasePlan(g.PHASE_ROLE_GROUPS, role_groups or ["no group loads in this process"],
                  subjects(g.IO_PROCESSOR, g.STAT_LOGGER, g.ENDPOINT, g.LOGITS_PROCESSOR)),
        PhasePlan(g.PHASE_CONFIG_HOOKS, hooks or ["no module:attr option set"]),
    ]
    if not chooses_platform:
        registries = [name for name, (_, readers) in all_registries().items() if roles & readers]
        phases.append(PhasePlan(g.PHASE_MANIFEST, [f"registries: {', '.join(registries) or 'none read here'}"],
                                [f"registry:{name}" for name in registries]))
    return phases


def format_plan(plans: list[ProcessPlan]) -> str:
    lines = []
    for plan in plans:
        lines.append(f"{plan.role} ({plan.where})")
        for index, phase in enumerate(plan.phases, 1):
            lines.append(f"  {index}. {phase.name}")
            lines.extend(f"       {detail}" for detail in phase.details)
    return "\n".join(lines)
