"""An HTTP middleware for `--middleware ae_endpoint_example.middleware:served_by` (config hook C8):
an async function (request, call_next) that adds `X-Served-By: asyncengine pid N` to every response,
so a client behind a load balancer can tell which server answered.

It runs in the server's process (the frontend); with AE_PLUGIN_RECORD set, its first call appends one
JSON line {"what": "middleware", "pid", "role"} there.
"""

from __future__ import annotations

import os
from typing import Any

from ae_endpoint_example import _record_once

__all__ = ["HEADER", "served_by"]

HEADER = "X-Served-By"


async def served_by(request: Any, call_next: Any) -> Any:
    response = await call_next(request)
    response.headers[HEADER] = f"asyncengine pid {os.getpid()}"
    _record_once("middleware", path=request.path)
    return response
