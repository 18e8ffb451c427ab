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
from asyncengine.config.pooling import PoolerConfig, apply_pooling
from asyncengine.sampling_params import GENERATION_CONFIG_FIELDS

logger = logging.getLogger(__name__)

# ModelConfig.model_impl: which implementation builds the model (EngineConfig.model_impl resolved).
NATIVE, TRANSFORMERS = "native", "transformers"

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
    # model's pooler (asyncengine/config/pooling.py).
    runner: str = "generate"
    pooler: PoolerConfig | None = None
    # "native" (a registered class) or "transformers" (EngineConfig.model_impl resolved against the
    # architecture: asyncengine/models/transformers_backend.py); the worker builds the model accordingly.
    model_impl: str = NATIVE
    trust_remote_code: bool = False  # the transformers backend may run the model's own modelling code

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
    model_impl = resolve_model_impl(config, names, hf_config, model_dir, architectures)
    check_expert_parallel(config, names, hf_config)

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
        # A vision-language model's vocabulary is its language model's (text_config).
        vocab_size=int(hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size") or 0),
        eos_token_ids=eos_ids,
        generation_defaults=defaults,
        hf_overrides=dict(config.hf_overrides),
        model_impl=model_impl,
        trust_remote_code=config.trust_remote_code,
    )
    model_config = apply_pooling(config, model_config, architectures)
    if model_config.model_impl == TRANSFORMERS and model_config.runner == "pooling":
        raise ConfigError(f"the pooling runner needs a native architecture; {', '.join(names)} runs through "
                          "transformers (model_impl), which is built for generation here", field="runner")
    return model_config


def resolve_model_impl(config: EngineConfig, names: list[str], hf_config: dict[str, Any], model_dir: Path,
                       architectures: ArchitectureTable | None) -> str:
    """NATIVE or TRANSFORMERS for the model's `names` (config.json's architectures), as `config.model_impl`
    asks: auto runs an architecture through transformers only when no class of ours (or a plugin's, or a
    model_class_overrides entry) has it, and says so in the log. Without `architectures` (a caller that
    checks none) auto means native. An architecture neither side can build is an error naming it."""
    native = architectures is None or any(architectures.is_supported(a) or a in config.model_class_overrides
                                          for a in names)
    if config.model_impl == NATIVE or (config.model_impl == "auto" and native):
        if not native:
            raise UnsupportedArchitectureError(
                f"model architecture(s) {', '.join(names)} of {model_dir} have no native implementation here and "
                f"model_impl is native, which forbids running them through transformers (model_impl auto or "
                f"transformers would); native: {', '.join(architectures.get_supported_archs())}"
                if architectures is not None else f"model architecture(s) {', '.join(names)} are not supported")
        return NATIVE
    reason = transformers_cannot_run(names, hf_config, trust_remote_code=config.trust_remote_code)
    if reason is not None:
        # vLLM's words ("... are not supported for now"), which plugin authors search for, then why not here.
        supported = f"; supported: {', '.join(architectures.get_supported_archs())}" if architectures is not None else ""
        raise UnsupportedArchitectureError(f"model architecture(s) {', '.join(names)} of {model_dir} are not supported "
                                           f"for now: no native class (a model plugin registers one), and {reason}"
                                           f"{supported}")
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        raise ConfigError(
            f"model architecture(s) {', '.join(names)} run through transformers' modelling code (model_impl "
            f"{config.model_impl}), which is built for one rank: tensor_parallel_size and pipeline_parallel_size "
            "must be 1 (only native architectures split over ranks, docs/models.md)",
            field="tensor_parallel_size" if config.tensor_parallel_size > 1 else "pipeline_parallel_size")
    if config.quantization is not None:
        raise ConfigError(f"quantization {config.quantization} applies to native architectures' layers; "
                          f"{', '.join(names)} runs through transformers (model_impl {config.model_impl})",
                          field="quantization")
    if config.enable_lora:
        raise ConfigError(f"LoRA adapters need a native architecture; {', '.join(names)} runs through transformers "
                          f"(model_impl {config.model_impl})", field="enable_lora")
    if config.model_impl == "auto":
        logger.warning("model architecture(s) %s have no native implementation here: running transformers' "
                       "modelling code over the paged KV cache (model_impl auto -> transformers; slower than "
                       "native, docs/models.md)", ", ".join(names))
    else:
        logger.info("model architecture(s) %s run through transformers' modelling code (model_impl transformers)",
                    ", ".join(names))
    return TRANSFORMERS


def check_expert_parallel(config: EngineConfig, names: list[str], hf_config: dict[str, Any]) -> None:
    """`enable_expert_parallel` needs a mixture of experts with at least one expert per tensor-parallel rank
    (a count the ranks do not divide is split as vLLM splits it: the earlier ranks hold one more)."""
    if not config.enable_expert_parallel:
        return
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    if experts == 0:
        raise ConfigError(f"enable_expert_parallel splits a mixture of experts over the ranks, and {', '.join(names)} "
                          "has no experts (config.json sets neither num_experts nor num_local_experts): drop "
                          "enable_expert_parallel", field="enable_expert_parallel")
    if experts < config.tensor_parallel_size:
        raise ConfigError(f"enable_expert_parallel gives each of the tensor_parallel_size="
                          f"{config.tensor_parallel_size} ranks whole experts, and {', '.join(names)} has {experts}: each rank needs at least one; "
                          f"lower tensor_parallel_size to {experts} or less, or drop enable_expert_parallel",
                          field="enable_expert_parallel")


def transformers_cannot_run(names: list[str], hf_config: dict[str, Any], *, trust_remote_code: bool) -> str | None:
    """Why transformers cannot build a causal LM for this config (None: it can): a class transformers exports
    under one of the architecture names, or, with trust_remote_code, the model files' own (`auto_map`)."""
    import transformers

    remote = "AutoModelForCausalLM" in auto_map_of(hf_config)
    if remote and trust_remote_code:
        return None
    for name in names:
        if name.endswith("ForCausalLM") and isinstance(getattr(transformers, name, None), type):
            return None
    if remote:
        return ("the model ships its own modelling code (auto_map AutoModelForCausalLM), which runs only with "
                "trust_remote_code (--trust-remote-code) set")
    return (f"transformers {transformers.__version__} has no causal language model class of that name, and the "
            "model ships no modelling code of its own (auto_map)")


def auto_map_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json's `auto_map` (the classes a model's own code files define, by "module.Class"), {} without one."""
    auto_map = hf_config.get("auto_map")
    return auto_map if isinstance(auto_map, dict) else {}


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
