"""ModelConfig: what the engine needs to know about the model, resolved once in the frontend.

It is a msgspec Struct so the frontend can ship it to other processes: they need not resolve the
model argument again (which may involve converting a GGUF file).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import msgspec

from asyncengine.config.context_length import derived_context_length
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError
from asyncengine.pooling.config import PoolerConfig, apply_pooling
from asyncengine.sampling_params import GENERATION_CONFIG_FIELDS

logger = logging.getLogger(__name__)

# The model served when none is named (`model=None`; the loader finds or fetches it, loader/model_source.py).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"



class ModelConfig(msgspec.Struct, kw_only=True):
    model_dir: str
    tokenizer_dir: str | None
    served_model_name: str
    architectures: list[str]
    # config.json with hf_overrides applied and, where transformers knows the model type, completed
    # with transformers' defaults: workers build the model from it without importing transformers.
    hf_config: dict[str, Any]
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    generation_defaults: dict[str, Any]
    hf_overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    # "generate" or "pooling" (EngineConfig.runner resolved against the architecture), and a pooling
    # model's pooler (asyncengine/pooling/config.py).
    runner: str = "generate"
    pooler: PoolerConfig | None = None

    @property
    def model(self) -> str:
        """vLLM's name for where the model is: its directory here (files already fetched)."""
        return self.model_dir

    def load_hf_config(self) -> Any:
        """The model's config as attributes (`config.hidden_size`), for building the model."""
        return SimpleNamespace(**self.hf_config)


class ArchitectureTable(Protocol):
    """What the architecture check asks of the model registry (asyncengine.interfaces.models.ModelRegistry)."""

    def is_supported(self, architecture: str) -> bool: ...

    def get_supported_archs(self) -> list[str]: ...


def build_model_config(config: EngineConfig, *, model_dir: Path, default_dtype: str, tokenizer: Any | None,
                       architectures: ArchitectureTable | None = None, tokenizer_dir: Path | None = None,
                       config_dir: Path | None = None) -> ModelConfig:
    """Resolve `config` against the model in `model_dir` (see `resolve_model_dir`); `default_dtype` is the
    platform's meaning of dtype "auto". With `architectures` (the frontend passes the model registry; the
    config sits below the registries, so it is handed in), the model's architecture must be one of them
    or have a `model_class_overrides` entry. `tokenizer_dir` and `config_dir` are where `tokenizer` and
    `hf_config_path` resolved to (default: `tokenizer_path`, and the model's directory)."""
    config_dir = config_dir or model_dir
    hf_config = complete_hf_config(config_dir, load_config_json(config_dir), config.hf_overrides,
                                   trust_remote_code=config.trust_remote_code)
    names = hf_config.get("architectures") or []
    if not isinstance(names, list) or not names:
        raise ModelLoadError(f"{model_dir / 'config.json'} names no model architecture (`architectures`)")
    if architectures is not None and not any(architectures.is_supported(a) or a in config.model_class_overrides
                                             for a in names):
        raise UnsupportedArchitectureError(
            f"model architecture(s) {', '.join(names)} of {model_dir} are not supported for now; "
            f"supported: {', '.join(architectures.get_supported_archs())}"
        )

    max_model_len = _max_model_len(config, hf_config)
    generation_config = _load_generation_config(model_dir) if config.generation_config == "auto" else {}
    eos_ids = _eos_token_ids(hf_config, generation_config, tokenizer)
    defaults = {
        field: generation_config[key]
        for field, key in GENERATION_CONFIG_FIELDS.items()
        if generation_config.get(key) is not None
    }
    # `do_sample: false` in generation_config.json means the model's authors want greedy by default.
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0

    model_config = ModelConfig(
        model_dir=str(model_dir),
        tokenizer_dir=None if config.skip_tokenizer_init else str(tokenizer_dir or tokenizer_path(config, model_dir)),
        served_model_name=next(iter(config.served_model_names), None) or config.model or DEFAULT_MODEL_NAME,
        architectures=list(names),
        hf_config=hf_config,
        dtype=default_dtype if config.dtype == "auto" else config.dtype,
        max_model_len=max_model_len,
        vocab_size=int(hf_config.get("vocab_size") or 0),
        eos_token_ids=eos_ids,
        generation_defaults=defaults,
        hf_overrides=dict(config.hf_overrides),
    )
    return apply_pooling(config, model_config, architectures)


def complete_hf_config(model_dir: Path, raw: dict[str, Any], overrides: dict[str, Any], *,
                       trust_remote_code: bool = False) -> dict[str, Any]:
    """config.json plus overrides, completed with transformers' defaults when it knows the model type
    (a plugin's own model type may be unknown to it: then the file's values are all there is; with
    `trust_remote_code`, a configuration class the model's files ship is run)."""
    from transformers import AutoConfig

    merged = {**raw, **overrides}
    try:
        completed = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                               **overrides).to_dict()
    except (ValueError, KeyError) as exc:
        logger.info("transformers does not know model type %r (%s): using config.json as is", raw.get("model_type"), exc)
        return merged
    completed.update({key: value for key, value in merged.items() if key not in completed})
    return completed


def tokenizer_path(config: EngineConfig, model_dir: Path) -> Path:
    return Path(config.tokenizer).expanduser() if config.tokenizer else model_dir


def load_config_json(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path} is missing") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _load_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _max_model_len(config: EngineConfig, hf_config: dict[str, Any]) -> int:
    derived = derived_context_length(hf_config)
    if config.max_model_len is None:
        if derived is None:
            raise ConfigError(
                "config.json gives no context length (max_position_embeddings); set max_model_len",
                field="max_model_len",
            )
        return derived
    if derived is not None and config.max_model_len > derived:
        raise ConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's context length ({derived}, "
            "from config.json); lower it, or raise max_position_embeddings through hf_overrides if you "
            "know the model handles it",
            field="max_model_len",
        )
    return config.max_model_len


def _eos_token_ids(hf_config: dict[str, Any], generation_config: dict[str, Any], tokenizer: Any | None) -> list[int]:
    ids: list[int] = []
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        hf_config.get("eos_token_id"),
        generation_config.get("eos_token_id"),
    ):
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
