"""The worker's choice of an attention backend for each attention layer.

The `attention_backend` option names one for every layer, when set (as vLLM's --attention-backend);
otherwise the platform's `get_attn_backend_cls(head_dim, dtype, block_size)` chooses, asked once per
distinct layer shape. Its answer is a registry name (or a "pkg.mod:Class" path, as vLLM's platforms
answer) and resolves through the registry, so an unknown name fails start-up, listing the known ones.
vLLM's descriptor form (get_impl_cls, no forward) resolves to its implementation class there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncengine.interfaces.attention import AttentionBackend
from asyncengine.interfaces.attention import AttentionBackendRegistry
from asyncengine.interfaces.attention import TORCH_PAGED, build_backend, missing_features
from asyncengine.errors import ConfigError, StartupError
from asyncengine.platforms.interface import ask_attn_backend, attn_backend_name
from asyncengine.plugin_runtime.contracts import check_backend_class
from asyncengine.interfaces.registry import reads

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform


@dataclass
class BackendChoice:
    names: list[str]  # per layer: the registry name (or class path) chosen
    backends: list[AttentionBackend]  # per layer: the instance built for it
    chosen_by: str  # "the attention_backend option", or "platform cpu"
    owners: dict[str, str]  # name -> "registered by built-in" (or by a plugin, ...), or "a class path"
    # Layers the platform's choice cannot serve (it lacks a sliding window or a soft cap): what they got instead.
    fallbacks: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """"all 22 layers: TORCH_PAGED (chosen by platform cpu; registered by built-in)", or per run of
        equal layers when they differ."""
        origins = "; ".join(f"{name}: {owner}" if len(self.owners) > 1 else owner
                            for name, owner in self.owners.items())
        fallbacks = "".join(f"; {note}" for note in self.fallbacks)
        if self.names and len(set(self.names)) == 1:
            return f"all {len(self.names)} layers: {self.names[0]} (chosen by {self.chosen_by}; {origins}){fallbacks}"
        runs: list[tuple[int, int, str]] = []  # (first layer, last layer, name)
        for index, name in enumerate(self.names):
            if runs and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], index, name)
            else:
                runs.append((index, index, name))
        parts = [f"layer {first}: {name}" if first == last else f"layers {first}-{last}: {name}"
                 for first, last, name in runs]
        return "; ".join(parts or ["no attention layers"]) + f" (chosen by {self.chosen_by}; {origins}){fallbacks}"


@reads("attention_backends", "worker")
def _registered_backend(name: str, chosen_by: str, option: str | None) -> tuple[type[AttentionBackend], str]:
    """The backend class `name` resolves to, and who provides it (for the start-up summary)."""
    cls = AttentionBackendRegistry.backend_class(name, chosen_by=chosen_by,
                                                 field="attention_backend" if option else None)
    entry = AttentionBackendRegistry.get(name)
    return cls, f"registered by {entry.owner}" if entry else "a class path"


@reads("attention_backends", "worker")
def select_attention_backends(platform: type[Platform], layers: list[Any], dtype: Any, block_size: int,
                              option: str | None = None) -> BackendChoice:
    """A backend instance per layer (`layers` carry num_heads, num_kv_heads, head_dim, scale, and may carry
    sliding_window, logits_soft_cap and sinks). A layer needing a feature the chosen backend lacks: with the
    `attention_backend` option, an error naming the layer and the feature; with the platform's choice, the
    built-in TORCH_PAGED (which has both) for that layer, said in the summary."""
    chosen_by = "the attention_backend option" if option else f"platform {platform.device_name}"
    answers: dict[tuple[int, Any, int], Any] = {}
    classes: dict[str, type[AttentionBackend]] = {}
    names, backends, owners, fallbacks = [], [], {}, []

    def backend_class(name: str) -> type[AttentionBackend]:
        if name not in classes:
            classes[name], owners[name] = _registered_backend(name, chosen_by, option)
            check_backend_class(name, classes[name], f"{owners[name]}, chosen by {chosen_by}")  # forward, not at step 1
        return classes[name]

    for index, layer in enumerate(layers):
        sliding_window = getattr(layer, "sliding_window", None)
        logits_soft_cap = getattr(layer, "logits_soft_cap", None)
        sinks = getattr(layer, "sinks", None)
        name: str | None
        if option:
            name = option
        else:
            shape = (layer.head_dim, dtype, block_size)
            if shape not in answers:
                answers[shape] = ask_attn_backend(platform, *shape)  # by keyword, as vLLM calls it
            name = attn_backend_name(answers[shape])
            if name is None:
                raise StartupError(
                    f"platform {platform.device_name}: get_attn_backend_cls(head_dim={shape[0]}, dtype={dtype}, "
                    f"block_size={block_size}) returned {answers[shape]!r}; it must return a registered attention "
                    f"backend name (registered: {', '.join(AttentionBackendRegistry.keys())}) or a "
                    "'pkg.mod:Class' path")
        missing = missing_features(backend_class(name), sliding_window, logits_soft_cap, sinks)
        if missing and option:
            raise ConfigError(f"attention backend {name!r} (the attention_backend option) cannot serve attention layer "
                              f"{index}: it needs {' and '.join(missing)}, which {name} does not support; leave "
                              f"attention_backend unset, or name a backend that does ({TORCH_PAGED} does)",
                              field="attention_backend")
        if missing:
            fallbacks.append(f"layer {index} needs {' and '.join(missing)}, which {name} lacks: {TORCH_PAGED}")
            name = TORCH_PAGED
            backend_class(name)
        names.append(name)
        # Ours take (num_heads, num_kv_heads, head_dim, scale); a vLLM descriptor's implementation, vLLM's keywords.
        backends.append(build_backend(classes[name], layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale,
                                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                      sinks=sinks))
    return BackendChoice(names, backends, chosen_by, owners, fallbacks)
