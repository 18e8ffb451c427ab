"""The Platform interface (EXTENSION_POINTS.md, "The Platform interface").

A platform is a class, used through its class methods (like vLLM's). Built-in `cpu` and `cuda`
implement it exactly as a plugin's platform does. Resolution checks that the identity attributes are
set and the hooks are callable, so a platform that lacks one fails there, naming it, never later.
Its device hooks that need torch call interfaces.torch_bases (the floor's one torch module) when called,
never at import.
"""

from __future__ import annotations

import enum
from typing import Any

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


class Platform:
    _enum: PlatformEnum = PlatformEnum.OOT  # the built-ins set theirs
    # Identity
    device_name: str | None = None  # "cpu", "cuda", or the plugin's name
    device_type: str | None = None  # the torch device string
    dist_backend: str = "gloo"  # torch.distributed backend for tensor parallelism (gloo runs on any host)
    supported_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    supported_quantization: tuple[str, ...] = ()
    default_dtype: str = "float32"  # what dtype="auto" means here
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
