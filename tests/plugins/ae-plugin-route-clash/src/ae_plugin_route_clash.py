"""An endpoint plugin that adds POST /v1/completions without asking to override the built-in route."""

from asyncengine.plugins_api import EndpointPlugin


class Clash(EndpointPlugin):
    name = "clash"

    def attach(self, app):
        @app.post("/v1/completions")
        async def completions():
            return {"mine": True}


def make_endpoint():
    return Clash()


class Override(EndpointPlugin):
    """Replaces the built-in GET /version, and says so."""

    name = "override"
    override = True

    def attach(self, app):
        @app.get("/version")
        async def version():
            return {"version": "from the override plugin"}


def make_override():
    return Override()
