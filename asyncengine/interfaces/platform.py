"""The Platform interface (docs/reference.md, "The Platform interface").

A platform is a class, used through its class methods (like vLLM's). Built-in `cpu` and `cuda`
implement it exactly as a plugin's platform does. Resolution checks that the identity attributes are
set and the hooks are callable, so a platform that lacks one fails there, naming it, never later.
Its device hooks that need torch call interfaces.torch_bases (the floor's one torch module) when called,
never at import.
"""

from __future__ import annotations

import enum
import os
from typing import Any, NamedTuple

from asyncengine.interfaces.attention import TORCH_PAGED


class PlatformEnum(enum.Enum):
    """vLLM's kinds of platform; an out-of-tree one sets `_enum = PlatformEnum.OOT`."""

    CUDA = enum.auto()
    ROCM = enum.auto()
    TPU = enum.auto()
    XPU = enum.auto()
    CPU = enum.auto()
    OOT = enum.auto()
    UNSPECIFIED = enum.auto()


class DeviceCapability(NamedTuple):
    """vLLM's compute capability of a device (CUDA's major.minor)."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """7.5 as 75, the form `has_device_capability(75)` takes."""
        return self.major * 10 + self.minor


class AttentionSelectorConfig(NamedTuple):
    """What vLLM's platforms receive as `attn_selector_config` in get_attn_backend_cls: the layer's shape and
    kind, with vLLM's field names (this engine's layers are decoder self-attention, no MLA, sinks or sparse)."""

    head_size: int
    dtype: Any  # a torch.dtype
    kv_cache_dtype: str | None
    block_size: int | None
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    use_mm_prefix: bool = False
    use_per_head_quant_scales: bool = False
    attn_type: str = "decoder"
    use_non_causal: bool = False
    use_batch_invariant: bool = False


def _as_int(capability: tuple[int, int] | int) -> int:
    """(8, 9) as 89, vLLM's integer form of a capability."""
    return capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability


class Platform:
    _enum: PlatformEnum = PlatformEnum.OOT  # the built-ins set theirs
    # Identity
    device_name: str | None = None  # "cpu", "cuda", or the plugin's name
    device_type: str | None = None  # the torch device string
    dist_backend: str = "gloo"  # torch.distributed backend for tensor parallelism (gloo runs on any host)
    supported_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    supported_quantization: tuple[str, ...] = ()
    default_dtype: str = "float32"  # what dtype="auto" means here
    # vLLM's other identity attributes, which its platforms set and its code reads.
    dispatch_key: str = "CPU"  # the torch dispatch key of the device
    ray_device_key: str = ""  # the resource name a Ray cluster schedules the device by
    device_control_env_var: str = ""  # the variable that hides devices (CUDA_VISIBLE_DEVICES)
    simple_compile_backend: str = "inductor"
    additional_env_vars: list[str] = []  # variables a worker process inherits (processes here inherit them all)
    # Optional: op -> op-provider names to try first, in order ({"rms_norm": ["my_kernel"]}); providers not
    # named follow by registered priority, "native" (torch) last. Empty: registered priorities alone.
    # The config's `op_priority` wins per op (asyncengine/models/layers/op_registry.py).
    op_priority: dict[str, list[str]] = {}
    # The `additional_config` keys this platform claims; it validates their values in
    # check_and_update_config. A key no platform or plugin claims is an error.
    additional_config_keys: tuple[str, ...] = ()

    REQUIRED_ATTRIBUTES = ("device_name", "device_type", "dist_backend")
    REQUIRED_HOOKS = (
        "pre_register_and_update", "check_and_update_config", "validate_request", "get_attn_backend_cls",
        "get_device_communicator_cls", "set_device", "seed_everything", "get_device_total_memory",
        "get_current_memory_usage", "inference_mode", "is_pin_memory_available",
    )

    # -- life cycle ------------------------------------------------------------------------------------

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Add CLI options (called by the CLI after --device/--plugins are pre-parsed)."""

    @classmethod
    def check_and_update_config(cls, config: Any) -> Any:
        """Validate the engine options for this platform and fill what it decides; return the config.
        This one sets `worker_cls="auto"` to the built-in Worker (CPU and CUDA use it); a platform with
        a worker of its own sets its "pkg.mod:Class" (a Worker subclass, checked in the config-hooks
        phase). A worker left at "auto" is the built-in one."""
        if getattr(config, "worker_cls", None) == "auto":
            from asyncengine.config.engine import BUILTIN_WORKER

            # In place (on the platform phase's own copy) and returned, so that a subclass written
            # either way (ours returns the config, vLLM's changes it and returns None) may call it.
            config.worker_cls = BUILTIN_WORKER
        return config

    @classmethod
    def validate_request(cls, prompt: Any, params: Any) -> None:
        """Called in the frontend for every request; raise RequestError to refuse one."""

    # -- selection -------------------------------------------------------------------------------------

    @classmethod
    def get_attn_backend_cls(cls, head_dim: int, dtype: Any, block_size: int) -> str:
        """The attention backend for layers of this shape: a name registered with
        `register_attention_backend` (or a "pkg.mod:Class" path). The worker resolves it through the
        registry, once per distinct shape; the `attention_backend` option, when set, wins."""
        return TORCH_PAGED  # plain torch runs on any torch device

    @classmethod
    def get_device_communicator_cls(cls) -> str | None:
        return None  # torch.distributed collectives on dist_backend

    # -- vLLM's questions about the kind of platform -------------------------------------------------

    @classmethod
    def is_cuda(cls) -> bool:
        return cls._enum == PlatformEnum.CUDA

    @classmethod
    def is_cpu(cls) -> bool:
        return cls._enum == PlatformEnum.CPU

    @classmethod
    def is_out_of_tree(cls) -> bool:
        return cls._enum == PlatformEnum.OOT

    @classmethod
    def is_rocm(cls) -> bool:
        return cls._enum == PlatformEnum.ROCM

    @classmethod
    def is_tpu(cls) -> bool:
        return cls._enum == PlatformEnum.TPU

    @classmethod
    def is_xpu(cls) -> bool:
        return cls._enum == PlatformEnum.XPU

    @classmethod
    def is_cuda_alike(cls) -> bool:
        """CUDA or ROCm: what vLLM's CUDA code paths (graphs, custom all-reduce) run on."""
        return cls._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM)

    @classmethod
    def is_unspecified(cls) -> bool:
        return cls._enum == PlatformEnum.UNSPECIFIED

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        return False  # vLLM's sleep mode (offloading weights between requests) is not built here

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        """A CUDA-like device's compute capability; None where the notion does not apply (CPU, others)."""
        return None

    @classmethod
    def has_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        """Whether the device's capability is at least `capability` ((8, 0) or 80); False without one."""
        current = cls.get_device_capability(device_id=device_id)
        return current is not None and current.to_int() >= _as_int(capability)

    @classmethod
    def is_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls.get_device_capability(device_id=device_id)
        return current is not None and current.to_int() == _as_int(capability)

    @classmethod
    def device_count(cls) -> int:
        """Devices of this platform's kind this process can use (a host-only platform has one: the host)."""
        return 1

    @classmethod
    def device_id_to_physical_device_id(cls, device_id: int) -> int:
        """vLLM's mapping through the device-visibility variable (`device_control_env_var`, e.g.
        CUDA_VISIBLE_DEVICES): the id it lists at `device_id`, else `device_id` itself."""
        variable = getattr(cls, "device_control_env_var", None)
        visible = os.environ.get(variable, "") if variable else ""
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if device_id < len(ids) and ids[device_id].isdigit():
            return int(ids[device_id])
        return device_id

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        raise NotImplementedError(f"platform {cls.device_name} has no device UUIDs")

    @classmethod
    def get_cpu_architecture(cls) -> str:
        import platform

        return platform.machine()

    @classmethod
    def supports_fp8(cls) -> bool:
        return False

    @classmethod
    def is_fp8_fnuz(cls) -> bool:
        return False

    @classmethod
    def use_all_gather(cls) -> bool:
        return True  # the vocabulary-parallel logits are gathered to every rank here

    @classmethod
    def use_custom_allreduce(cls) -> bool:
        return False

    @classmethod
    def supports_v1(cls, model_config: Any = None) -> bool:
        return True  # this engine's design is vLLM's v1

    @classmethod
    def default_v1(cls, model_config: Any = None) -> bool:
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        """vLLM's check of a quantization name against `supported_quantization` (empty: any is allowed)."""
        supported = cls.supported_quantization
        if supported and quant not in supported:
            raise ValueError(f"{quant} quantization is currently not supported on {cls.device_name}; supported: "
                             f"{', '.join(supported)}")

    @classmethod
    def verify_model_arch(cls, model_arch: str) -> None:
        """vLLM's hook to refuse an architecture this platform cannot run; every one passes by default."""

    @classmethod
    def check_if_supports_dtype(cls, dtype: Any) -> None:
        """vLLM's hook to refuse a dtype; every one passes by default."""

    @classmethod
    def log_warnings(cls) -> None:
        """vLLM's hook for platform warnings at start-up; none by default."""

    @classmethod
    def import_kernels(cls) -> None:
        """vLLM imports its compiled ops here; this engine's kernels are imported where they are used."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """vLLM's name of the device; here the platform's device_name."""
        return str(cls.device_name)

    @classmethod
    def is_async_output_supported(cls, enforce_eager: bool | None) -> bool:
        """vLLM v0's question; async output processing belongs to the engine loop here, never to the platform."""
        return False

    # -- device ----------------------------------------------------------------------------------------

    @classmethod
    def set_device(cls, device: Any) -> None:
        pass

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        from asyncengine.interfaces.torch_bases import seed_everything  # the floor's torch module

        seed_everything(seed)

    @classmethod
    def get_device_total_memory(cls, device: Any) -> int:
        raise NotImplementedError(f"platform {cls.device_name} does not report device memory")

    @classmethod
    def get_current_memory_usage(cls, device: Any) -> int:
        raise NotImplementedError(f"platform {cls.device_name} does not report memory usage")

    @classmethod
    def inference_mode(cls) -> Any:
        from asyncengine.interfaces.torch_bases import inference_mode

        return inference_mode()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    # -- detection (built-ins only; a plugin's detector is its entry point) --------------------------------

    @classmethod
    def is_available(cls) -> bool:
        return True
