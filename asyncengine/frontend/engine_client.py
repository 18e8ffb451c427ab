"""EngineClient: what the server (and the pooling helpers it shares with LLM, llm_pooling.py) uses of the
engine it serves; vLLM's name for the same protocol.

Implemented by AsyncEngine (async_engine.py) and so by the render server's RenderClient, its subclass
(server/render_server.py, `has_engine` False); tests' fake engines implement the part their routes call.
The server names this Protocol rather than AsyncEngine so that what a route needs is listed in one place and
anything shaped like the engine's request methods can be served. It lives here, not in server/, because
llm_pooling's helpers take it too. Attributes are read-only properties, which a plain attribute satisfies.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncengine.config.engine import EngineConfig
    from asyncengine.config.model import ModelConfig
    from asyncengine.errors import EngineDeadError
    from asyncengine.frontend.lora import LoRAAdapters
    from asyncengine.frontend.pooling import PoolingPrompt
    from asyncengine.frontend.processor import ProcessedRequest
    from asyncengine.frontend.tokenizer_pool import TokenizerPool
    from asyncengine.interfaces.stat_logger import StatLoggerBase
    from asyncengine.outputs import RequestOutput
    from asyncengine.pooling.outputs import PoolingRequestOutput
    from asyncengine.pooling.params import PoolingParams
    from asyncengine.plugin_runtime.phases import PluginState
    from asyncengine.wire.engine_core import SchedulerStats
    from asyncengine.wire.startup import StartupRecord


class EngineClient(Protocol):
    """The engine's request methods and the facts the routes report (the model, its config, its health)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer, or None under skip_tokenizer_init

    @property
    def chat_template(self) -> str | None: ...

    @property
    def plugins(self) -> PluginState: ...

    @property
    def tokenizer_pool(self) -> TokenizerPool: ...

    @property
    def lora_adapters(self) -> LoRAAdapters: ...

    @property
    def startup_report(self) -> list[StartupRecord]: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> EngineDeadError | None: ...

    def dead_engine_indexes(self) -> list[int]: ...

    async def wait_dead(self) -> EngineDeadError: ...

    async def shutdown(self, grace_period: float = 30.0) -> None: ...

    # The request methods' own signatures are AsyncEngine's (many keyword options); callers pass them through.
    def process_request(self, *args: Any, **kwargs: Any) -> ProcessedRequest: ...

    async def open_stream(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]: ...

    async def render_chat(self, *args: Any, **kwargs: Any) -> str: ...

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str: ...

    def request_group(self) -> str: ...

    def pooling_task_default(self) -> str: ...

    def prepare_pooling(self, prompt: Any, params: PoolingParams | None, *, task: str | None = None,
                        pair: Any = None, field: str = "prompt") -> PoolingPrompt: ...

    def check_fits_the_queue(self, count: int, field: str) -> None: ...

    async def run_pooling(self, prepared: PoolingPrompt, request_id: str | None = None, *,
                          nowait: bool = False) -> PoolingRequestOutput: ...

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] | list[Any] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    async def get_scheduler_stats(self) -> SchedulerStats: ...

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None: ...
