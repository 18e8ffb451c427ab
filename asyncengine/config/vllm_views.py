"""vLLM-shaped views on the flat EngineConfig, for code written against vLLM's VllmConfig.

vLLM groups its options in sub-configs (`vllm_config.parallel_config.worker_cls`,
`vllm_config.cache_config.block_size`); asyncengine keeps one flat EngineConfig. A platform's
`check_and_update_config` written for vLLM reads and writes through these views: a name that maps to
one of our fields reads and writes that field; a name that has no meaning here is accepted (a write is
kept in the view, a read of a name never written gives None) and noted, and the platform phase lists
each note in the start-up report as "ignored", so nothing a plugin set vanishes unseen. Names that
mean one derived thing here (`world_size` is tensor_parallel_size x pipeline_parallel_size) read that
value and refuse another.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator
from typing import Any

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
        "data_parallel_rank": "data_parallel_rank",
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
    "load_config": {"load_format": "load_format", "download_dir": "download_dir"},
    "compilation_config": {},  # nothing here is compiled by a config: every name is noted as ignored
}

# section -> vLLM attribute -> the one value it has here
FIXED: dict[str, dict[str, Any]] = {
    "parallel_config": {},
}

# vLLM's other top-level sub-configs: none is used here, each reads None (and is noted).
ABSENT_SECTIONS = (
    "speculative_config", "lora_config", "observability_config", "structured_outputs_config",
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
            return getattr(self._config, FIELD_MAPS[section][name])
        if name == "world_size" and section == "parallel_config":
            return self._config.world_size
        if name in FIXED.get(section, {}):
            return FIXED[section][name]
        if name in self._kept:
            return self._kept[name]
        _note(f"{section}.{name} was read: it has no meaning in asyncengine, so it reads None")
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        from asyncengine.config.class_paths import class_to_path
        from asyncengine.errors import ConfigError

        section = self._section
        if name in FIELD_MAPS[section]:
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
