"""The frontend's `model` start-up phase: find the model, load the tokenizer, resolve the model
description. It runs in a thread: it reads files and may convert a GGUF model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from asyncengine.config.engine import EngineConfig
from asyncengine.config.model import ModelConfig, build_model_config, tokenizer_path
from asyncengine.frontend.tokenizer import load_tokenizer, read_chat_template, tokenizer_class
from asyncengine.loader.model_source import resolve_model_dir
from asyncengine.loader.registry import ModelLoaderRegistry
from asyncengine.models.layers.quantization import QuantizationRegistry
from asyncengine.registries.base import reads


@dataclass
class FrontendSetup:
    model_config: ModelConfig
    tokenizer: Any | None
    chat_template: str | None


@reads("model_loaders", "frontend")  # the --load-format name, checked before anything starts
@reads("quantization", "frontend")  # the quantization method's name, likewise
def prepare(config: EngineConfig, platform: Any, *, progress: bool = True) -> FrontendSetup:
    # The loader name is checked here, once the general plugins (which may register loaders) have run,
    # before a possibly long GGUF conversion; the worker builds the model with it.
    ModelLoaderRegistry.loader_class(config.load_format)
    if config.quantization is not None:
        QuantizationRegistry.config_class(config.quantization)
    if not config.skip_tokenizer_init:  # so is the tokenizer mode (R9): an unknown one lists the known ones
        tokenizer_class(config.tokenizer_mode)
    model_dir = resolve_model_dir(config.model, cache_dir=config.download_dir, progress=progress)
    tokenizer = (None if config.skip_tokenizer_init
                 else load_tokenizer(tokenizer_path(config, model_dir), config.tokenizer_mode))
    chat_template = read_chat_template(config.chat_template)
    model_config = build_model_config(config, model_dir=model_dir, default_dtype=platform.default_dtype,
                                      tokenizer=tokenizer)
    return FrontendSetup(model_config, tokenizer, chat_template)


async def prepare_async(config: EngineConfig, platform: Any) -> FrontendSetup:
    return await anyio.to_thread.run_sync(prepare, config, platform)
