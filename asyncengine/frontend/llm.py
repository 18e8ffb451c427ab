"""LLM: the blocking, batch-at-once API (vLLM's `LLM` class)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.config.engine import config_from_dict
from asyncengine.errors import RequestError
from asyncengine.frontend.llm_engine import LLMEngine
from asyncengine.frontend.output_processor import OutputKind
from asyncengine.frontend.tokenizer import render_chat
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

# A progress bar appears by default only for batches at least this large.
PROGRESS_BAR_MIN_PROMPTS = 32


class LLM:
    """`LLM(model=None, **engine_options)`; `model=None` is the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = config_from_dict({"model": model, **config})
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.processor.default_sampling_params()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; outputs come back in input order.

        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt.
        A prompt is a string or `{"prompt_token_ids": [...]}`.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = chat_template or self.engine.chat_template
        prompts = [
            render_chat(self.engine.tokenizer, conversation, template, add_generation_prompt=add_generation_prompt)
            for conversation in conversations
        ]
        # The template already wrote any BOS token: tokenize without adding special tokens again.
        token_prompts = [
            {"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}
            for text in prompts
        ]
        params_list = self._params_per_prompt(sampling_params, len(token_prompts))
        return self._run(token_prompts, params_list, use_tqdm)

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

    def _run(self, prompts: list[Any], params_list: list[SamplingParams | None], use_tqdm: bool | None) -> list[RequestOutput]:
        engine = self.engine
        # Validate every prompt before any is queued, so a bad one leaves nothing half-started.
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_ids.append(engine.add_request(None, prompt, params, OutputKind.FINAL_ONLY))
        except RequestError:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        show_bar = use_tqdm if use_tqdm is not None else len(prompts) >= PROGRESS_BAR_MIN_PROMPTS
        bar = None
        if show_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="req", dynamic_ncols=True)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in finished:
                    engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id in request_ids]
