"""CustomOp: a layer whose forward is chosen per platform, and that a plugin can replace by name. The
one module of the floor that imports torch (CustomOp is an nn.Module; the torch work of the other
interfaces' defaults is here too); imported only by who asks for it.

vLLM's names and semantics (docs/reference.md, custom ops):
- `forward` dispatches to `forward_<device_type>` of the current platform ("cpu", "cuda", or an
  out-of-tree platform's device type) when the class defines it; else, on an out-of-tree platform,
  to `forward_oot` when defined; else to `forward_native`, the torch reference every op must have.
  On an out-of-tree platform, a `forward_oot` defined below the class that defines the device's method
  (a plugin's replacement of an in-tree op) runs first, as vLLM does.
  The choice is made at an instance's first call (the platform is resolved by then) and kept.
- `@CustomOp.register("RMSNorm")` names an in-tree op class.
- `@CustomOp.register_oot(name="RMSNorm")` (or `CustomOp.register_oot(MyRMSNorm, name="RMSNorm")`)
  replaces it: building `RMSNorm(...)` then builds the out-of-tree class, with the same arguments.
  Register it from a general plugin, so that the worker processes, which build the model, have it.

The tables are in interfaces/custom_op_registry.py (torch-free, for the frontend's manifest); the
in-tree ops' torch code runs through op providers (asyncengine/models/layers/op_registry.py, `call_op`), of which
`native` is the reference. Which platform this process runs is the platform phase's answer: it publishes
it in the torch-free table module (`dispatch_platform`) when it resolves one; importing a module installs
nothing.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from asyncengine.interfaces.custom_op_registry import (
    dispatch_platform,
    oot_replacement,
    register_custom_op,
    register_oot_op,
)
from asyncengine.interfaces.registry import RegistrationError


def _defined_below(cls: type, method: str, other: str) -> bool:
    """Whether `cls` (or a base) defines `method` in a class that comes before the one defining `other` in
    its method resolution order (`method` overridden below `other`); False when `other` is not defined."""
    for klass in cls.__mro__:
        if method in vars(klass) and klass is not CustomOp:
            return any(other in vars(base) for base in cls.__mro__[cls.__mro__.index(klass) + 1:])
        if other in vars(klass):
            return False
    return False


class CustomOp(nn.Module):
    # An in-tree op's registered name, set by `register` on that class only (read from its own __dict__).
    _custom_op_name: str

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Only the registered in-tree class itself is replaced, not its subclasses (the replacement is
        # usually one of them): the name is read from the class's own namespace.
        name = cls.__dict__.get("_custom_op_name")
        replacement = oot_replacement(name) if name is not None else None
        if replacement is None or replacement is cls:
            return super().__new__(cls)
        if isinstance(replacement, type) and issubclass(replacement, cls):
            return super().__new__(replacement)  # Python then runs replacement.__init__(*args, **kwargs)
        return replacement(*args, **kwargs)  # not a subclass: built whole here, and cls.__init__ is skipped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        name = self.__dict__.get("_forward_name")
        if name is None:
            name = self._forward_name = self.dispatch_forward()
        return getattr(self, name)(*args, **kwargs)

    def dispatch_forward(self) -> str:
        """The name of the method `forward` runs on the current platform."""
        platform, out_of_tree = dispatch_platform()
        device_method = f"forward_{platform.device_type}"
        candidates = [device_method]
        if out_of_tree:
            # The platform's own device method wins, except over a forward_oot defined further down the
            # class tree: a plugin's register_oot replacement that overrides forward_oot is asking for it
            # (vLLM always runs forward_oot on an out-of-tree platform) even when the in-tree op it
            # subclasses has a kernel for the same device type, e.g. forward_cpu on a CPU-type platform.
            oot_first = _defined_below(type(self), "forward_oot", device_method)
            candidates.insert(0 if oot_first else 1, "forward_oot")
        for candidate in candidates:
            if callable(getattr(type(self), candidate, None)):
                return candidate
        return "forward_native"

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} defines no forward_native (the torch reference)")

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        """An out-of-tree platform's path; by default the torch reference, so that a replacement may
        call `super().forward_oot(...)` as vLLM's do."""
        return self.forward_native(*args, **kwargs)

    @classmethod
    def register(cls, name: str):
        """Class decorator: an in-tree op named `name` (which `register_oot` can then replace)."""

        def decorate(op_class: type) -> type:
            if not (isinstance(op_class, type) and issubclass(op_class, CustomOp)):
                raise RegistrationError(f"CustomOp.register({name!r}) decorates a CustomOp subclass, got {op_class!r}")
            if op_class.forward_native is CustomOp.forward_native:
                raise RegistrationError(f"custom op {name!r} ({op_class.__qualname__}) must define forward_native, "
                                        "the torch reference every op has")
            register_custom_op(name, op_class)
            op_class._custom_op_name = name
            return op_class

        return decorate

    @classmethod
    def register_oot(cls, op_class: type | str | None = None, *, name: str | None = None, override: bool = False):
        """Replace the in-tree op `name` by `op_class`; usable as a decorator. The default name is the op's
        it is called on (`@RotaryEmbedding.register_oot`, vLLM's form), else the class's own name;
        `CustomOp.register_oot("RMSNorm")` names it positionally.

        A name that matches no in-tree op is a RegistrationError listing the op names. Registering the
        same class twice is a no-op; another class for a name already replaced needs `override=True`.
        """
        if isinstance(op_class, str):  # the positional-string form: a decorator for that name
            op_class, name = None, op_class
        in_tree_name: str | None = cls.__dict__.get("_custom_op_name")  # called on an in-tree op class itself

        def decorate(op_class: type) -> type:
            default_name: str = getattr(op_class, "__name__", "")
            register_oot_op(name or in_tree_name or default_name, op_class, override=override)
            return op_class

        return decorate if op_class is None else decorate(op_class)


# -- the torch work of the floor's other interfaces (Platform's defaults, BaseModelLoader.load_model) ---------


def seed_everything(seed: int) -> None:
    """Platform.seed_everything's default: Python's, numpy's and torch's generators."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device(name: Any) -> Any:
    """`torch.device(name)` (a model loader's target device)."""
    return torch.device(name)


def inference_mode() -> Any:
    """Platform.inference_mode's default."""
    return torch.inference_mode()


def build_on_device(model_cls: type, hf_config: Any, *, dtype: str, device: Any, max_position: int) -> Any:
    """`model_cls(hf_config, dtype=..., max_position=...)` with its parameters created on `device`."""
    with torch.device(device):
        return model_cls(hf_config, dtype=getattr(torch, dtype), max_position=max_position)


def float_dtypes() -> list[torch.dtype]:
    """The floating dtypes a model runs in here (bfloat16, float16, float32): a quantization method's
    activation dtypes unless it says otherwise (QuantizationConfig.get_supported_act_dtypes)."""
    return [torch.bfloat16, torch.float16, torch.float32]


__all__ = ["CustomOp", "build_on_device", "float_dtypes", "inference_mode", "seed_everything"]
