"""Two kinds of --middleware: an async function (request, call_next) and an ASGI middleware class."""

from ae_plugin_server import record


async def tag_response(request, call_next):
    response = await call_next(request)
    response.headers["X-Ae-Function-Middleware"] = "ran"
    if request.path == "/v1/models":
        record("function middleware", path=request.path)
    return response


class AsgiTag:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-ae-asgi-middleware", b"ran")]}
                if scope["path"] == "/v1/models":
                    record("asgi middleware", path=scope["path"])
            await send(message)

        await self.app(scope, receive, tagged_send)
