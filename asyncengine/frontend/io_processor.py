"""IOProcessor: the interface of IO-processor plugins (entry-point group asyncengine.io_processor_plugins).

Read in the frontend: `pre_process` turns a request into prompts, `post_process` turns the outputs
into the response. The plugin's entry point is a callable returning the subclass's path; the one
used is chosen by `io_processor_plugin` (`--io-processor-plugin NAME`).
"""

from __future__ import annotations

from typing import Any


class IOProcessor:
    def __init__(self, engine_config: Any = None) -> None:
        self.engine_config = engine_config

    def pre_process(self, request: Any) -> Any:
        raise NotImplementedError

    def post_process(self, outputs: Any) -> Any:
        raise NotImplementedError
