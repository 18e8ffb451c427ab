"""The custom-op tables (docs/reference.md, custom ops): in-tree op classes and their out-of-tree
replacements (`custom_ops`), and the op providers (`op_providers`, several implementations of one op).

Torch-free: the frontend builds its manifest from these registries, and a general plugin registers into
them there too. The CustomOp class is in interfaces/torch_bases.py; the providers' per-call choice
(priorities, `supported` predicates, `call_op`) is in asyncengine/models/layers/op_registry.py; the
built-in providers are registered here by path, so every process's table lists them.

`custom_ops` holds in-tree op name -> class ("RMSNorm"), and `oot:<name>` -> the out-of-tree class that
replaces it (`CustomOp.register_oot`). The built-in names are registered here as lazy paths, so every
process knows them (and can refuse an unknown name) before any model module is imported.
"""

from __future__ import annotations

from typing import Any

from asyncengine.errors import ModelLoadError, StartupError
from asyncengine.interfaces.imports import import_by_path
from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, reads

CustomOpRegistry: Registry[Any] = Registry("custom_ops", "custom op")
OpProviderRegistry: Registry[Any] = Registry("op_providers", "op provider")

OOT_PREFIX = "oot:"

# The platform CustomOp dispatches for, and whether it is out of tree (not a built-in, so `forward_oot` is
# a candidate): published by the platform phase (plugin_runtime/platform_resolution.py, set_current_platform)
# when it resolves the process's platform; None before that.
_dispatch_platform: tuple[Any, bool] | None = None


# Any, not type[Platform]: interfaces.platform reaches this module (through torch_bases), so naming it is a cycle.
def publish_dispatch_platform(platform: Any, out_of_tree: bool) -> None:
    """The platform phase's answer, for CustomOp's dispatch (None: not resolved)."""
    global _dispatch_platform
    _dispatch_platform = None if platform is None else (platform, out_of_tree)


def dispatch_platform() -> tuple[Any, bool]:
    """(the current platform, whether it is out of tree); StartupError before the platform phase ran."""
    if _dispatch_platform is None:
        raise StartupError("a CustomOp cannot choose its forward: the platform is not resolved yet (it is chosen "
                           "in the first start-up phase of a process: AsyncEngine.start, LLM(...), the CLI); "
                           "code that builds and runs ops must run after that")
    return _dispatch_platform

# The built-in op providers ("<op>/<provider>"), by path: their code needs torch (and triton), and how
# each is chosen per call (priority, `supported`, whether it runs here) is models/layers/op_registry.py's.
# "native" is the torch reference; "triton" the kernels of ops/, tried first where a CUDA device is.
BUILT_IN_PROVIDERS = {
    "rms_norm/native": "asyncengine.models.layers.norm:rms_norm_native",
    "rotary/native": "asyncengine.models.layers.rotary:rotary_native",
    "silu_and_mul/native": "asyncengine.models.layers.activation:silu_and_mul_native",
    "sample/native": "asyncengine.worker.sample_op:sample_native",
    "fused_moe/native": "asyncengine.ops.fused_moe:fused_moe_reference",
    "rms_norm/triton": "asyncengine.ops.triton_norm:rms_norm_triton",
    "rotary/triton": "asyncengine.ops.triton_rotary:rotary_triton",
    "silu_and_mul/triton": "asyncengine.ops.triton_activation:silu_and_mul_triton",
    "sample/triton": "asyncengine.ops.triton_sampling:sample_triton",
    "fused_moe/triton": "asyncengine.ops.triton_moe:fused_moe_triton",
}

# The in-tree ops, by path: importing them needs torch.
IN_TREE_OPS = {
    "RMSNorm": "asyncengine.models.layers.norm:RMSNorm",
    "GemmaRMSNorm": "asyncengine.models.layers.norm:GemmaRMSNorm",
    "RotaryEmbedding": "asyncengine.models.layers.rotary:RotaryEmbedding",
    "SiluAndMul": "asyncengine.models.layers.activation:SiluAndMul",
    "FusedMoE": "asyncengine.models.layers.fused_moe:FusedMoE",
    "GeluAndMul": "asyncengine.models.layers.activation:GeluAndMul",
}


def in_tree_op_names() -> list[str]:
    return [key for key in CustomOpRegistry.keys() if not key.startswith(OOT_PREFIX)]


def register_custom_op(name: str, op_class: Any) -> None:
    """Register an in-tree op class under `name` (what `@CustomOp.register(name)` does)."""
    if not isinstance(name, str) or not name or name.startswith(OOT_PREFIX):
        raise RegistrationError(f"a custom op needs a name (a non-empty string, not starting with "
                                f"{OOT_PREFIX!r}), got {name!r}")
    CustomOpRegistry.register(name, op_class)


def register_oot_op(name: str, op_class: Any, *, override: bool = False) -> None:
    """Make building the in-tree op `name` build `op_class` instead (what `CustomOp.register_oot` does)."""
    if not isinstance(op_class, (type, str)):
        raise RegistrationError(f"CustomOp.register_oot takes a class (or 'pkg.mod:Class'), got {op_class!r}")
    known = in_tree_op_names()
    if name not in known:
        raise RegistrationError(
            f"CustomOp.register_oot: {name!r} is not an in-tree custom op, so there is nothing to replace; "
            f"the op names are: {', '.join(known)}"
        )
    CustomOpRegistry.register(OOT_PREFIX + name, op_class, override=override)


@reads("custom_ops", "worker")
def oot_replacement(name: str) -> type | None:
    """The out-of-tree class registered for the in-tree op `name`, if any (looked up per construction)."""
    entry = CustomOpRegistry.get(OOT_PREFIX + name)
    if entry is None:
        return None
    if isinstance(entry.implementation, str):
        return import_by_path(entry.implementation, what=f"out-of-tree custom op {name!r}", error=ModelLoadError)
    return entry.implementation


for _name, _path in IN_TREE_OPS.items():
    CustomOpRegistry.register(_name, _path, owner=BUILT_IN)
for _key, _path in BUILT_IN_PROVIDERS.items():
    OpProviderRegistry.register(_key, _path, owner=BUILT_IN)


__all__ = ["BUILT_IN_PROVIDERS", "IN_TREE_OPS", "OOT_PREFIX", "CustomOpRegistry", "OpProviderRegistry",
           "dispatch_platform", "in_tree_op_names", "oot_replacement", "publish_dispatch_platform",
           "register_custom_op", "register_oot_op"]
