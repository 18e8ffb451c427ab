"""vLLM-shaped views on the flat EngineConfig, for code written against vLLM's VllmConfig.

vLLM groups its options in sub-configs (`vllm_config.parallel_config.worker_cls`,
`vllm_config.cache_config.block_size`); asyncengine keeps one flat EngineConfig. A platform's
`check_and_update_config` written for vLLM reads and writes through these views: a name that maps to
one of our fields reads and writes that field; a name that has no meaning here is accepted (a write is
kept in the view, a read of a name never written gives None) and noted, and the platform phase lists
each note in the start-up report as "ignored", so nothing a plugin set vanishes unseen. Names that
mean one derived thing here (`world_size` is tensor_parallel_size x pipeline_parallel_size) read that
value and refuse another.

Values show resolved, as vLLM's config does by the time a platform or a worker reads it: an option left to
its default reads what it resolves to (`max_num_batched_tokens` 2048, `distributed_executor_backend` uni or
mp, `model_config.max_model_len` the model's context length, `model_config.dtype` a torch.dtype), and the
model's own questions (`hf_config`, `get_head_size()`, `get_num_kv_heads(parallel_config)`, ...) are
answered from the model as this process resolved it (`remember_resolved_model`), or before that from its
directory's config.json.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncengine.config.context_length import derived_context_length

# section -> vLLM attribute -> our EngineConfig field
FIELD_MAPS: dict[str, dict[str, str]] = {
    "model_config": {
        "model": "model", "tokenizer": "tokenizer", "tokenizer_mode": "tokenizer_mode",
        "skip_tokenizer_init": "skip_tokenizer_init", "served_model_name": "served_model_name",
        "dtype": "dtype", "seed": "seed", "max_model_len": "max_model_len", "quantization": "quantization",
        "hf_overrides": "hf_overrides", "enforce_eager": "enforce_eager", "max_logprobs": "max_logprobs",
        "generation_config": "generation_config", "revision": "revision",
        "tokenizer_revision": "tokenizer_revision", "hf_config_path": "hf_config_path",
        "trust_remote_code": "trust_remote_code",
    },
    "parallel_config": {
        "tensor_parallel_size": "tensor_parallel_size",
        "pipeline_parallel_size": "pipeline_parallel_size", "data_parallel_size": "data_parallel_size",
        "data_parallel_rank": "data_parallel_rank", "enable_expert_parallel": "enable_expert_parallel",
        "distributed_executor_backend": "distributed_executor_backend",
        "worker_cls": "worker_cls", "worker_extension_cls": "worker_extension_cls",
        "scheduler_cls": "scheduler_cls",  # older vLLM platforms set it here
    },
    "scheduler_config": {
        "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
        "enable_chunked_prefill": "enable_chunked_prefill", "max_model_len": "max_model_len",
        "scheduler_cls": "scheduler_cls", "async_scheduling": "async_scheduling",
    },
    "cache_config": {
        "block_size": "block_size", "gpu_memory_utilization": "gpu_memory_utilization",
        "enable_prefix_caching": "enable_prefix_caching", "num_gpu_blocks_override": "num_gpu_blocks_override",
        "kv_cache_memory_bytes": "kv_cache_memory_bytes", "cache_dtype": "kv_cache_dtype",
    },
    "device_config": {"device": "device"},
    "load_config": {"load_format": "load_format", "download_dir": "download_dir",
                    "model_loader_extra_config": "model_loader_extra_config"},
    "compilation_config": {},  # nothing here is compiled by a config: every name is noted as ignored
}

# section -> vLLM attribute -> the one value it has here
FIXED: dict[str, dict[str, Any]] = {
    "parallel_config": {},
}

# vLLM's list- and dict-valued settings that platforms change in place (`compilation_config.custom_ops.append(
# "+rms_norm")`, `"+x" in cops`): a read of one never written gives vLLM's empty default, kept, so the change
# persists and is listed as ignored like any other write.
EMPTY_CONTAINERS: dict[str, dict[str, type]] = {
    "compilation_config": {"custom_ops": list, "splitting_ops": list, "compile_sizes": list,
                           "cudagraph_capture_sizes": list, "static_forward_context": dict},
}

# vLLM's other top-level sub-configs: none is used here, each reads None (and is noted). speculative_config is
# not among them: it is EngineConfig's own field, read as it is.
ABSENT_SECTIONS = (
    "lora_config", "observability_config", "structured_outputs_config",
    "decoding_config", "kv_events_config", "ec_transfer_config", "quant_config", "prompt_adapter_config",
    "profiler_config",
)

_notes: list[str] | None = None  # collecting: the platform phase gathers what its hook did that is ignored


@contextmanager
def collecting_ignored() -> Iterator[list[str]]:
    """Gather the notes of ignored reads and writes made while the block runs."""
    global _notes
    outer, _notes = _notes, []
    _kept_by_config.clear()  # what an earlier hook set on names with no meaning is not this one's
    try:
        yield _notes
    finally:
        _notes = outer


def _note(message: str) -> None:
    if _notes is not None and message not in _notes:
        _notes.append(message)


class SubConfigView:
    """One of vLLM's sub-configs, reading and writing through to the EngineConfig it views."""

    def __init__(self, config: Any, section: str) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_section", section)
        object.__setattr__(self, "_kept", _kept_for(config, section))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        section = self._section
        if name in FIELD_MAPS[section]:
            value = getattr(self._config, FIELD_MAPS[section][name])
            return _resolved(self._config, section, name, value)
        if section == "model_config" and name in _MODEL_QUESTIONS:
            return _MODEL_QUESTIONS[name](_ModelFacts(self._config))
        if name == "world_size" and section == "parallel_config":
            return self._config.world_size
        if name in FIXED.get(section, {}):
            return FIXED[section][name]
        if name in self._kept:
            return self._kept[name]
        if name in EMPTY_CONTAINERS.get(section, {}):
            empty = self._kept[name] = EMPTY_CONTAINERS[section][name]()
            _note(f"{section}.{name} was read: it has no meaning in asyncengine; it starts empty, as vLLM's")
            return empty
        _note(f"{section}.{name} was read: it has no meaning in asyncengine, so it reads None")
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        from asyncengine.config.class_paths import class_to_path
        from asyncengine.errors import ConfigError

        section = self._section
        if name in FIELD_MAPS[section]:
            if FIELD_MAPS[section][name] == "dtype" and not isinstance(value, str):
                value = str(value).removeprefix("torch.")  # torch.float16, vLLM's type, is "float16" here
            setattr(self._config, FIELD_MAPS[section][name], class_to_path(value))
            return
        fixed = FIXED.get(section, {})
        if name in fixed or (name == "world_size" and section == "parallel_config"):
            current = getattr(self, name)
            if value != current:
                raise ConfigError(f"{section}.{name} = {value!r}: asyncengine has {current} here and no other "
                                  "value (world_size is tensor_parallel_size x pipeline_parallel_size)", field=name)
            return
        self._kept[name] = value
        _note(f"{section}.{name} = {value!r} was set: it has no meaning in asyncengine and is ignored")

    def __repr__(self) -> str:
        mapped = {name: getattr(self._config, field) for name, field in FIELD_MAPS[self._section].items()}
        return f"<{self._section} view: {mapped}>"


# -- resolved values ---------------------------------------------------------------------------------------

# What this process resolved: the model (our ModelConfig) per `model` option, and the platform (for what
# dtype "auto" means before the model is resolved). Set by the frontend's start-up and by each worker.
# Held as Any: ModelConfig and Platform import config.engine, which imports this module (a cycle to name).
_resolved_models: dict[str | None, Any] = {}
_platform: list[Any] = [None]


def remember_resolved_model(model_option: str | None, model_config: Any) -> None:
    """The model the `model` option `model_option` resolved to in this process (a ModelConfig)."""
    _resolved_models[model_option] = model_config


def resolved_model(config: Any) -> Any:
    """The ModelConfig this process resolved for `config`'s model option; None before that."""
    return _resolved_models.get(config.model)


def remember_platform(platform: Any) -> None:  # a type[Platform]
    """This process's platform (its `default_dtype` is what dtype "auto" means before a model is resolved)."""
    _platform[0] = platform


class _ModelFacts:
    """The model an EngineConfig names: as resolved in this process, else read from its directory."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.resolved = _resolved_models.get(config.model)

    @property
    def hf_config(self) -> dict[str, Any]:
        if self.resolved is not None:
            return dict(self.resolved.hf_config)
        model = self.config.model
        path = Path(model).expanduser() / "config.json" if isinstance(model, str) else None
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return {}
            return {**data, **self.config.hf_overrides} if isinstance(data, dict) else {}
        return {}

    def max_model_len(self) -> int | None:
        if self.resolved is not None:
            return int(self.resolved.max_model_len)
        return derived_context_length(self.hf_config)

    def dtype(self) -> Any:
        name = self.resolved.dtype if self.resolved is not None else self.config.dtype
        if name == "auto":
            platform = _platform[0]
            name = getattr(platform, "default_dtype", None) if platform is not None else None
            if name is None:
                return "auto"  # neither the model nor the platform is resolved yet
        import torch  # a torch.dtype is what vLLM's code compares with (model_config.dtype == torch.bfloat16)

        return getattr(torch, str(name))


def _resolved(config: Any, section: str, name: str, value: Any) -> Any:
    """An option's value as it resolves, where it was left to a default."""
    if section == "model_config" and name == "dtype":
        return _ModelFacts(config).dtype()
    if name == "max_model_len" and value is None:
        return _ModelFacts(config).max_model_len()
    if section == "model_config" and name == "model" and value is None:
        resolved = _resolved_models.get(None)
        return resolved.model_dir if resolved is not None else None
    if section == "model_config" and name == "tokenizer" and value is None:
        resolved = _resolved_models.get(config.model)
        return resolved.tokenizer_dir if resolved is not None else config.model
    if section == "scheduler_config" and name == "max_num_batched_tokens":
        return config.effective_max_num_batched_tokens
    if section == "parallel_config" and name == "distributed_executor_backend":
        return config.executor_backend
    return value


class AttrDict(dict[str, Any]):
    """A config as a dict (ours reads it so) whose keys are attributes too (vLLM's code reads
    `hf_config.hidden_size`); nested dicts are AttrDicts as well."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(f"the model's config has no {name!r}") from None
        return AttrDict(value) if isinstance(value, dict) and not isinstance(value, AttrDict) else value

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


def _hf(facts: _ModelFacts) -> AttrDict:
    return AttrDict(facts.hf_config)


def _text(facts: _ModelFacts) -> AttrDict:
    config = facts.hf_config
    text = config.get("text_config")
    return AttrDict(text if isinstance(text, dict) and "num_attention_heads" in text else config)


def _uses_mrope(facts: _ModelFacts) -> bool:
    """vLLM's rule: the text config's rope settings (`rope_parameters`, or the older `rope_scaling`) carry an
    `mrope_section` (the Qwen-VL family: asyncengine/models/layers/mrope.py)."""
    text = _text(facts)
    return any(isinstance(rope, dict) and "mrope_section" in rope
               for rope in (text.get("rope_parameters"), text.get("rope_scaling")))


def _heads(facts: _ModelFacts) -> int:
    return int(_text(facts).get("num_attention_heads") or 0)


def _kv_heads(facts: _ModelFacts) -> int:
    text = _text(facts)
    return int(text.get("num_key_value_heads") or text.get("num_attention_heads") or 0)


def _head_size(facts: _ModelFacts) -> int:
    text = _text(facts)
    heads = _heads(facts)
    return int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads if heads else 0))


def _tp(parallel_config: Any) -> int:
    return int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)


def _architectures(facts: _ModelFacts) -> list[str]:
    return list(facts.resolved.architectures if facts.resolved is not None else facts.hf_config.get("architectures") or [])


# vLLM's ModelConfig questions (attributes, and methods as functions of the facts), answered from the model.
_MODEL_QUESTIONS: dict[str, Any] = {
    "hf_config": _hf,
    "hf_text_config": _text,
    "architectures": _architectures,
    "architecture": lambda f: next(iter(_architectures(f)), None),
    "runner_type": lambda f: f.resolved.runner if f.resolved is not None else f.config.runner,
    "is_encoder_decoder": lambda f: False,
    "is_multimodal_model": lambda f: False,
    "uses_mrope": _uses_mrope,
    "get_hidden_size": lambda f: lambda: int(_text(f).get("hidden_size") or 0),
    "get_head_size": lambda f: lambda: _head_size(f),
    "get_total_num_attention_heads": lambda f: lambda: _heads(f),
    "get_num_attention_heads": lambda f: lambda parallel_config=None: max(1, _heads(f) // _tp(parallel_config)),
    "get_total_num_kv_heads": lambda f: lambda: _kv_heads(f),
    "get_num_kv_heads": lambda f: lambda parallel_config=None: max(1, _kv_heads(f) // _tp(parallel_config)),
    "get_num_layers": lambda f: lambda parallel_config=None: int(_text(f).get("num_hidden_layers") or 0),
    "get_vocab_size": lambda f: lambda: int(_text(f).get("vocab_size") or 0),
    "get_sliding_window": lambda f: lambda: _text(f).get("sliding_window"),
}


# Writes to names with no meaning here, per config and section (by id: Structs take no new attributes),
# so that a hook reads back what it wrote; cleared when the next hook's collection starts.
_kept_by_config: dict[tuple[int, str], dict[str, Any]] = {}


def _kept_for(config: Any, section: str) -> dict[str, Any]:
    return _kept_by_config.setdefault((id(config), section), {})


class VllmConfigViews:
    """Mixed into EngineConfig: `config.parallel_config` and the other vLLM sub-config names."""

    __slots__ = ()

    @property
    def model_config(self) -> SubConfigView:
        return SubConfigView(self, "model_config")

    @property
    def parallel_config(self) -> SubConfigView:
        return SubConfigView(self, "parallel_config")

    @property
    def scheduler_config(self) -> SubConfigView:
        return SubConfigView(self, "scheduler_config")

    @property
    def cache_config(self) -> SubConfigView:
        return SubConfigView(self, "cache_config")

    @property
    def device_config(self) -> SubConfigView:
        return SubConfigView(self, "device_config")

    @property
    def load_config(self) -> SubConfigView:
        return SubConfigView(self, "load_config")

    @property
    def compilation_config(self) -> SubConfigView:
        return SubConfigView(self, "compilation_config")

    def __getattr__(self, name: str) -> Any:
        # Only on a miss: vLLM's other sub-configs read None here; any other name is a real AttributeError.
        if name in ABSENT_SECTIONS:
            _note(f"{name} was read: asyncengine has none, so it reads None")
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
