"""LLMEngine: the frontend and an in-process engine core, driven one step at a time by the caller.

Start-up resolves, in order: the device, the model directory (converting a GGUF file once), the
tokenizer, the model description, then the engine core (which loads the weights and sizes the KV
cache). The blocking `LLM` and `asyncengine generate` use it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig, build_model_config, resolve_device, tokenizer_path
from asyncengine.engine_core.core import EngineCore
from asyncengine.errors import RequestError
from asyncengine.frontend.output_processor import OutputKind, OutputProcessor
from asyncengine.frontend.processor import InputProcessor
from asyncengine.frontend.tokenizer import load_tokenizer, read_chat_template
from asyncengine.loader.model_source import resolve_model_dir
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        model_dir = resolve_model_dir(config.model, cache_dir=config.download_dir, progress=progress)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(tokenizer_path(config, model_dir))
        self.chat_template = read_chat_template(config.chat_template)
        self.model_config: ModelConfig = build_model_config(
            config, model_dir=model_dir, device=self.device, tokenizer=self.tokenizer
        )
        self.engine_core = EngineCore(config, self.model_config, self.device)
        self.processor = InputProcessor(config, self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        logger.info(
            "engine ready: model %s (%s, %s) on %s, %d KV blocks of %d tokens",
            self.model_config.served_model_name, self.model_config.architectures[0], self.model_config.dtype,
            self.device, self.engine_core.num_blocks, config.block_size,
        )

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def add_request(
        self,
        request_id: str | None,
        prompt: Any,
        params: SamplingParams | None,
        kind: OutputKind = OutputKind.DELTA,
    ) -> str:
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor._requests:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        processed = self.processor.process(request_id, prompt, params)
        self.output_processor.add_request(processed, kind)
        for child in processed.children:
            self.engine_core.add_request(child)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.core_requests_to_abort:
            self.engine_core.abort_requests(processed.core_requests_to_abort)
        return processed.request_outputs
