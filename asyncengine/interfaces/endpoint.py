"""EndpointPlugin: the interface of endpoint plugins (entry-point group asyncengine.endpoint_plugins).

Read in the frontend, and opt-in: an endpoint plugin loads only when the allow-list names it, since
it adds network routes. Two forms are served:

- ours: `attach(app)` adds Quart routes to the HTTP app; `serve(engine_client, task_status)` runs
  background work in the server's task group (call `task_status.started()` once ready);
- vLLM's (`vllm.endpoint_plugins`): `attach_router(app)` adds routes to a FastAPI app, and
  `init_state(engine_client, state, args)` (optional, may be async) fills that app's `state` before the
  server takes requests. The server gives each such plugin a FastAPI app of its own and serves it as
  a mounted ASGI application on the paths it declared (asyncengine/server/fastapi_endpoints.py); it
  needs the package `fastapi`, and without it start-up fails naming the plugin and the package.

Either form may say `required_tasks` (vLLM's: a tuple of task names, or None for any): when none of
them is a task this server serves (`served_tasks`: by the runner, checked with the other contracts
when it is given, and by the server once `auto` has resolved; the render server serves "render"
only, RENDER_TASKS), start-up fails naming the plugin,
where vLLM leaves the plugin out silently. A route that clashes with a built-in route is an error unless
`override` is true.
"""

from __future__ import annotations

import abc
from typing import Any

import anyio

# The tasks a generating server serves, by vLLM's names (vllm.tasks.SupportedTask).
GENERATE_TASKS: tuple[str, ...] = ("generate",)
# What a pooling runner serves, by the same names.
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "token_embed", "token_classify")
# What the render server (server/render_server.py: no engine) serves: vLLM's task of its render server.
RENDER_TASKS: tuple[str, ...] = ("render",)


class EndpointPlugin(abc.ABC):
    """Subclass it (ours: attach), or write vLLM's form as a plain class: isinstance() is true for an
    object with `attach_router` too, as for vLLM's runtime-checkable protocol of that name."""

    name: str = ""
    override: bool = False
    required_tasks: tuple[str, ...] | None = None

    def attach(self, app: Any) -> None:
        raise NotImplementedError

    async def serve(self, engine_client: Any, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    @classmethod
    def __subclasshook__(cls, candidate: type) -> Any:
        if cls is EndpointPlugin and callable(getattr(candidate, "attach_router", None)):
            return True  # vLLM's form
        return NotImplemented


def is_router_form(plugin: Any) -> bool:
    """vLLM's form: an `attach_router(app)` and no `attach(app)` of ours."""
    if not callable(getattr(plugin, "attach_router", None)):
        return False
    attach = getattr(type(plugin), "attach", None)
    return attach is None or attach is EndpointPlugin.attach


def served_tasks(runner: str | None) -> tuple[str, ...] | None:
    """The tasks (vLLM's names) a server with this runner serves; None while it is "auto" (the model
    decides, once its architecture is known)."""
    if runner == "pooling":
        return POOLING_TASKS
    if runner == "generate":
        return GENERATE_TASKS
    return None


def required_tasks_problem(plugin: Any, runner: str | None, tasks: tuple[str, ...] | None = None) -> str | None:
    """Why `plugin.required_tasks` refuses a server with this runner ("generate", "pooling"; "auto"
    checks only the value's shape), or serving `tasks` when given (the render server's RENDER_TASKS,
    whatever the runner), or None when it may serve there."""
    required = getattr(plugin, "required_tasks", None)
    if required is None:
        return None
    if not isinstance(required, (tuple, list, set, frozenset)) or not all(isinstance(t, str) for t in required):
        return f"required_tasks is {required!r}: give a tuple of task names (vLLM's), or None for any task"
    served = tasks if tasks is not None else served_tasks(runner)
    if served is None or set(required) & set(served):
        return None
    where = ("or serve it with `asyncengine serve` (a render server has no engine: it serves the task 'render' "
             "only)") if served == RENDER_TASKS else "or serve a model for one of those tasks"
    return (f"requires one of the tasks {', '.join(required) or '(none)'}, and this server serves "
            f"{', '.join(served)}: leave the plugin out of the allow-list (--plugins), {where}")
