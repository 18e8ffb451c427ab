"""LLM: the blocking, batch-at-once API (vLLM's `LLM` class), on the same AsyncEngine as everything else.

The engine runs in an event loop on a thread of its own (an anyio blocking portal); each call here
submits its prompts to it and waits for every final output. `close()` (or leaving `with LLM() as
llm:`) shuts the engine down; so does the interpreter's exit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import anyio
from anyio.from_thread import start_blocking_portal

from asyncengine.config.engine import config_from_dict
from asyncengine.errors import RequestError
from asyncengine.frontend.async_engine import AsyncEngine
from asyncengine.frontend.output_processor import OutputKind
from asyncengine.frontend.llm_pooling import LLMPooling
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.wire.engine_core import SchedulerStats

# A progress bar appears by default only for batches at least this large.
PROGRESS_BAR_MIN_PROMPTS = 32


class LLM(LLMPooling):  # embed / encode / classify / score (frontend/llm_pooling.py)
    """`LLM(model=None, **engine_options)`; `model=None` is the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = config_from_dict({"model": model, **config})
        self._resources = ExitStack()
        try:
            self._portal = self._resources.enter_context(start_blocking_portal(backend="trio", name="asyncengine"))
            self.engine: AsyncEngine = self._resources.enter_context(
                self._portal.wrap_async_context_manager(AsyncEngine.start(self.config))
            )
        except BaseException:
            self._resources.close()
            raise
        self._finalizer = weakref.finalize(self, _close_elsewhere, self._resources)

    def close(self) -> None:
        """Shut the engine down (its processes and threads included)."""
        if self._finalizer.detach() is not None:
            self._resources.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.processor.default_sampling_params()

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._portal.call(self.engine.get_scheduler_stats)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] | list[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's signature (AsyncEngine.collective_rpc); `collective_rpc(method, args)` still works."""
        return self._portal.call(self.engine.collective_rpc, method, timeout, args, kwargs)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; outputs come back in input order.

        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt.
        A prompt is a string or `{"prompt_token_ids": [...]}`, and for a multimodal model may carry images:
        `{"prompt": "...<image>...", "multi_modal_data": {"image": image_or_list}}` (docs/multimodal.md).
        `lora_request`: one LoRARequest for all
        prompts, or a list with one (or None, the base model) per prompt (docs/lora.md).
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, self._loras_per_prompt(lora_request, len(prompt_list)))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool | None = None,
        chat_template_content_format: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        As in vLLM: `continue_final_message` (with `add_generation_prompt=False`) continues the last,
        assistant, message instead of starting a new one; `chat_template_kwargs` reach the template;
        messages are taken as the OpenAI API sends them (content parts, tool calls with null content, tool
        messages), shaped for the template as `chat_template_content_format` says (None: the engine's
        option, "auto" by default)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        render_options = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools,
                              template_kwargs=chat_template_kwargs, content_format=chat_template_content_format)
        prompts = self._portal.call(self._chat_prompts, conversations, render_options)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm)

    # -- helpers -----------------------------------------------------------------------------------------

    def _params_per_prompt(self, sampling_params: Any, count: int) -> list[SamplingParams | None]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise RequestError(
                f"got {len(params_list)} SamplingParams for {count} prompts; pass one, or one per prompt",
                field="sampling_params",
            )
        return params_list

    @staticmethod
    def _loras_per_prompt(lora_request: Any, count: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise RequestError(f"got {len(loras)} LoRA requests for {count} prompts; pass one, or one per prompt",
                               field="lora_request")
        return loras

    def _run(self, prompts: list[Any], params_list: list[SamplingParams | None], use_tqdm: bool | None,
             loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        # Validate every prompt before any is queued, so a bad one leaves nothing half-started.
        processed = self._portal.call(self._process_all, prompts, params_list, loras or [None] * len(prompts))
        show_bar = use_tqdm if use_tqdm is not None else len(prompts) >= PROGRESS_BAR_MIN_PROMPTS
        bar = None
        if show_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            return self._portal.call(self._collect, processed, bar)
        finally:
            if bar is not None:
                bar.close()

    async def _chat_prompts(self, conversations: list[Any], render_options: dict[str, Any]) -> list[dict[str, Any]]:
        return [await self.engine.chat_prompt(conversation, **render_options) for conversation in conversations]

    async def _process_all(self, prompts: list[Any], params_list: list[SamplingParams | None],
                           loras: list[LoRARequest | None]) -> list[Any]:
        # In the engine's tokenizer pool, one after another: the event loop goes on running the engine.
        return [await self.engine.process_request_async(p, params, lora_request=lora)
                for p, params, lora in zip(prompts, params_list, loras)]

    async def _collect(self, processed: list[Any], bar: Any) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(processed)
        failures: list[Exception] = []

        async def one(index: int, scope: anyio.CancelScope) -> None:
            try:
                async for output in self.engine.submit(processed[index], OutputKind.FINAL_ONLY):
                    results[index] = output
            except Exception as exc:  # the first failure (a dead engine) is re-raised below, unwrapped
                failures.append(exc)
                scope.cancel()
                return
            if bar is not None:
                bar.update(1)

        async with anyio.create_task_group() as tg:
            for index in range(len(processed)):
                tg.start_soon(one, index, tg.cancel_scope)
        if failures:
            raise failures[0]
        finished = [result for result in results if result is not None]
        if len(finished) != len(results):  # a stream that ends without its final output is the engine's bug
            raise RuntimeError(f"the engine ended {len(results) - len(finished)} of {len(results)} requests "
                               "without a final output")
        return finished


def _close_elsewhere(resources: ExitStack) -> None:
    """Close an LLM that was garbage-collected without close().

    Collection can happen on any thread, the engine's own event-loop thread included, where waiting
    for the engine to stop would deadlock; so the closing happens on a thread of its own. At
    interpreter exit no new thread may start, and closing in place is safe.
    """
    try:
        threading.Thread(target=resources.close, name="asyncengine-close").start()
    except RuntimeError:
        resources.close()
