"""EndpointPlugin: the interface of endpoint plugins (entry-point group asyncengine.endpoint_plugins).

Read in the frontend, and opt-in: an endpoint plugin loads only when the allow-list names it, since
it adds network routes. `attach(app)` adds its routes to the HTTP app; `serve(engine_client,
task_status)` runs background work in the server's task group (call `task_status.started()` once
ready). A route that clashes with a built-in route is an error unless `override` is true.
"""

from __future__ import annotations

from typing import Any

import anyio


class EndpointPlugin:
    name: str = ""
    override: bool = False

    def attach(self, app: Any) -> None:
        raise NotImplementedError

    async def serve(self, engine_client: Any, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
