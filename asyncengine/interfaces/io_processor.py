"""IOProcessor: the interface of IO-processor plugins (entry-point group asyncengine.io_processor_plugins).

Read in the frontend: `pre_process` turns a request into prompts, `post_process` turns the outputs
into the response. The plugin's entry point is a callable returning the subclass (or its path); the
one used is chosen by `io_processor_plugin` (`--io-processor-plugin NAME`), and the server serves it
at POST /v1/io_process (asyncengine/server/serving_io_processor.py, docs/server.md).
"""

from __future__ import annotations

from typing import Any


class IOProcessor:
    """Subclass it and override both methods. Each may be a plain method (the server runs it in a worker
    thread, so it may block) or an `async def` (awaited on the server's event loop: it must not block).

    Built once, when the server starts, as `cls(engine_config)`.
    """

    def __init__(self, engine_config: Any = None) -> None:
        self.engine_config = engine_config

    def pre_process(self, request: Any) -> Any:
        """`request` is the body of POST /v1/io_process (an `IOProcessRequest`: `request.data` is your
        input, any JSON value; the sampling fields are there too). Return the prompts to generate: a
        prompt or a list of them, each a string, a list of token ids, or `{"prompt": str}` /
        `{"prompt_token_ids": [...]}`. Raise `RequestError` or `ValueError` to refuse bad input (HTTP
        400); any other exception is a 500 naming the plugin."""
        raise NotImplementedError

    def post_process(self, outputs: Any) -> Any:
        """`outputs` holds one finished `RequestOutput` per prompt, in the order pre_process gave them.
        Return the response's `data`: anything msgspec encodes as JSON (dicts, lists, Structs, ...)."""
        raise NotImplementedError
