"""The frontend's `model` start-up phase: find the model, load the tokenizer, resolve the model
description. It runs in a thread: it reads files and may convert a GGUF model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from asyncengine.config.class_paths import is_class_path
from asyncengine.config.engine import EngineConfig
from asyncengine.config.vllm_views import remember_resolved_model
from asyncengine.config.model import ModelConfig, build_model_config, tokenizer_path
from asyncengine.errors import ConfigError
from asyncengine.frontend.multimodal import MultiModalInputs, multimodal_inputs
from asyncengine.frontend.speculative import check_speculative_model
from asyncengine.frontend.tokenizer import load_tokenizer, read_chat_template, tokenizer_class
from asyncengine.interfaces.attention import AttentionBackendRegistry
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.loader.model_source import resolve_files_dir, resolve_model_dir
from asyncengine.interfaces.model_loader import ModelLoaderRegistry
from asyncengine.interfaces.quantization import resolve_quantization_name
from asyncengine.interfaces.quantization import QuantizationRegistry
from asyncengine.pooling.default_model import default_pooling_model_dir, wants_default_pooling_model
from asyncengine.interfaces.registry import describe, reads

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform


@dataclass
class FrontendSetup:
    model_config: ModelConfig
    tokenizer: Any | None
    chat_template: str | None
    # A multimodal model's image processing (frontend/multimodal.py); None for a model that takes no images.
    multimodal: MultiModalInputs | None = None


@reads("model_loaders", "frontend")  # the --load-format name, checked before anything starts
@reads("quantization", "frontend")  # the quantization method's name, likewise
@reads("models", "frontend")  # the architecture must be one the worker can build
@reads("hook:model_class_overrides", "frontend")
def prepare(config: EngineConfig, platform: type[Platform], *, progress: bool = True) -> FrontendSetup:
    # The loader name is checked here, once the general plugins (which may register loaders) have run,
    # before a possibly long GGUF conversion; the worker builds the model with it.
    ModelLoaderRegistry.loader_class(config.load_format)
    if config.quantization is not None:  # an unknown name fails here, listing the known ones
        QuantizationRegistry.load(config.quantization)
    _check_attention_backend_name(config.attention_backend)
    if not config.skip_tokenizer_init:  # so is the tokenizer mode: an unknown one lists the known ones
        tokenizer_class(config.tokenizer_mode)
    if wants_default_pooling_model(config.model, config.runner):  # all-MiniLM-L6-v2, from its package
        model_dir = default_pooling_model_dir(Path(config.download_dir) if config.download_dir else None)
    else:
        model_dir = resolve_model_dir(config.model, cache_dir=config.download_dir, progress=progress,
                                      revision=config.revision)
    # --tokenizer and --hf-config-path: a directory, or ORG/NAME fetched like the model (vLLM's flags)
    tokenizer_dir = (resolve_files_dir(config.tokenizer, cache_dir=config.download_dir, what="tokenizer",
                                       revision=config.tokenizer_revision)
                     if config.tokenizer and not config.skip_tokenizer_init else tokenizer_path(config, model_dir))
    config_dir = (resolve_files_dir(config.hf_config_path, cache_dir=config.download_dir, what="hf_config_path",
                                    revision=config.revision) if config.hf_config_path else None)
    tokenizer = (None if config.skip_tokenizer_init
                 else load_tokenizer(tokenizer_dir, config.tokenizer_mode, trust_remote_code=config.trust_remote_code))
    chat_template = read_chat_template(config.chat_template)
    model_config = build_model_config(config, model_dir=model_dir, default_dtype=platform.default_dtype,
                                      tokenizer=tokenizer, architectures=ModelRegistry, tokenizer_dir=tokenizer_dir,
                                      config_dir=config_dir)
    # The method the worker will build (a plugin's override_quantization_method may claim the checkpoint):
    # it checks the model and the options before a worker builds it.
    chosen = resolve_quantization_name(config.quantization, model_config.load_hf_config())
    if chosen is not None:
        _verify_quantization(QuantizationRegistry.load(chosen), chosen, config, model_config, platform)
    check_speculative_model(config, model_config, tokenizer)  # the draft's vocabulary, before anything starts
    remember_resolved_model(config.model, model_config)  # what vLLM's config views show a plugin from now on
    return FrontendSetup(model_config, tokenizer, chat_template, multimodal_inputs(config, model_config, tokenizer))


@reads("attention_backends", "frontend")  # the --attention-backend name (the worker builds the backend)
def _check_attention_backend_name(name: str | None) -> None:
    """An unknown name fails here, listing the registered ones, not once a worker has loaded the model."""
    if name is not None and AttentionBackendRegistry.get(name) is None and not is_class_path(name):
        AttentionBackendRegistry.backend_class(name, chosen_by="the attention_backend option",
                                               field="attention_backend")  # raises, naming the registered ones


def _verify_quantization(method: Any, name: str, config: EngineConfig, model_config: ModelConfig,
                         platform: type[Platform]) -> None:
    hook = "verify_config"
    try:
        method.verify_config(config, model_config.load_hf_config())
        hook = "get_min_capability"
        minimum = int(method.get_min_capability())
    except ConfigError:
        raise
    except Exception as exc:  # the method's own failure: named with the method, as a configuration error
        raise ConfigError(f"quantization method {name!r} ({describe(method)}) raised in "
                          f"{hook}: {type(exc).__name__}: {exc}", field="quantization") from exc
    # vLLM's check: a device reporting a compute capability (CUDA) must reach the method's minimum.
    capability = getattr(platform, "get_device_capability", lambda: None)()
    if capability is not None and minimum > 0 and capability.to_int() < minimum:
        raise ConfigError(f"quantization method {name!r} needs compute capability {minimum // 10}.{minimum % 10} "
                          f"or higher (get_min_capability); this device has {capability.to_int() // 10}."
                          f"{capability.to_int() % 10}", field="quantization")


async def prepare_async(config: EngineConfig, platform: type[Platform]) -> FrontendSetup:
    return await anyio.to_thread.run_sync(prepare, config, platform)
