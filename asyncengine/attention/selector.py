"""The worker's choice of an attention backend for each attention layer.

The `attention_backend` option names one for every layer, when set (as vLLM's --attention-backend);
otherwise the platform's `get_attn_backend_cls(head_dim, dtype, block_size)` chooses, asked once per
distinct layer shape. Its answer is a registry name (or a "pkg.mod:Class" path, as vLLM's platforms
answer) and resolves through the registry, so an unknown name fails start-up, listing the known ones.
vLLM's descriptor form (get_impl_cls, no forward) resolves to its implementation class there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncengine.attention.backend import AttentionBackend
from asyncengine.attention.registry import AttentionBackendRegistry
from asyncengine.interfaces.attention import build_backend
from asyncengine.errors import StartupError
from asyncengine.platforms.interface import ask_attn_backend, attn_backend_name
from asyncengine.plugin_runtime.contracts import check_backend_class
from asyncengine.registries.base import reads


@dataclass
class BackendChoice:
    names: list[str]  # per layer: the registry name (or class path) chosen
    backends: list[AttentionBackend]  # per layer: the instance built for it
    chosen_by: str  # "the attention_backend option", or "platform cpu"
    owners: dict[str, str]  # name -> "registered by built-in" (or by a plugin, ...), or "a class path"

    def summary(self) -> str:
        """"all 22 layers: TORCH_PAGED (chosen by platform cpu; registered by built-in)", or per run of
        equal layers when they differ."""
        origins = "; ".join(f"{name}: {owner}" if len(self.owners) > 1 else owner
                            for name, owner in self.owners.items())
        if self.names and len(set(self.names)) == 1:
            return f"all {len(self.names)} layers: {self.names[0]} (chosen by {self.chosen_by}; {origins})"
        runs: list[tuple[int, int, str]] = []  # (first layer, last layer, name)
        for index, name in enumerate(self.names):
            if runs and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], index, name)
            else:
                runs.append((index, index, name))
        parts = [f"layer {first}: {name}" if first == last else f"layers {first}-{last}: {name}"
                 for first, last, name in runs]
        return "; ".join(parts or ["no attention layers"]) + f" (chosen by {self.chosen_by}; {origins})"


@reads("attention_backends", "worker")
def select_attention_backends(platform: Any, layers: list[Any], dtype: Any, block_size: int,
                              option: str | None = None) -> BackendChoice:
    """A backend instance per layer (`layers` carry num_heads, num_kv_heads, head_dim, scale)."""
    chosen_by = "the attention_backend option" if option else f"platform {platform.device_name}"
    answers: dict[tuple[int, Any, int], Any] = {}
    classes: dict[str, type[AttentionBackend]] = {}
    names, backends, owners = [], [], {}
    for layer in layers:
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
        if name not in classes:
            classes[name] = AttentionBackendRegistry.backend_class(
                name, chosen_by=chosen_by, field="attention_backend" if option else None)
            entry = AttentionBackendRegistry.get(name)
            owners[name] = f"registered by {entry.owner}" if entry else "a class path"
            check_backend_class(name, classes[name], f"{owners[name]}, chosen by {chosen_by}")  # forward, not at step 1
        names.append(name)
        # Ours take (num_heads, num_kv_heads, head_dim, scale); a vLLM descriptor's implementation, vLLM's keywords.
        backends.append(build_backend(classes[name], layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale))
    return BackendChoice(names, backends, chosen_by, owners)
