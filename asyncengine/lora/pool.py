"""The worker's adapters: a fixed pool of `max_loras` slots in every wrapped layer, filled from a CPU cache.

`LoRAPool.wrap(model, ...)` replaces each attention and MLP projection of a loaded model (qkv_proj,
o_proj, gate_up_proj, down_proj) with its LoRA-wrapped form (lora/layers.py); the pool's memory is
allocated then, once, and never grows: `max_loras` slots whatever the number of adapters served.

- `add(lora)` when a request joins the worker: the adapter's config is checked and its matrices read
  into the CPU cache (`max_cpu_loras` adapters, least recently used out), so a bad adapter fails only
  that request, before it runs.
- `check(name, path)` when an adapter is loaded by name (lora_modules at start-up, a runtime load, a
  resolver's answer): its config and every matrix's shape (the safetensors header alone) against the
  layers, so an adapter made for another model is refused then, and never registered.
- `begin_step(rows)` before a forward pass: every adapter of the step gets a slot (a free one, else the
  least recently used one no request of this step needs; its matrices from the CPU cache, or read again
  from its directory if the cache dropped it), and the step's per-token assignment goes to the layers.
  The scheduler admits no more distinct adapters than `max_loras` at once, so a step always fits.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncengine.lora.layers import ColumnParallelLoRA, LoRAContext, LoRAStep, RowParallelLoRA, _LoRALinear
from asyncengine.lora.peft import (AdapterConfig, AdapterShapes, AdapterWeights, LoRAAdapterError, read_adapter_config,
                                   read_adapter_shapes, read_adapter_weights)
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.models.layers.linear import ColumnParallelLinear, RowParallelLinear

# Our fused layer -> the checkpoint projections it holds, in output order (models/llama.py fuses them).
WRAPPED_LAYERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _CachedAdapter:
    request: LoRARequest
    config: AdapterConfig
    weights: AdapterWeights


class LoRAPool:
    def __init__(self, layers: dict[tuple[int, str], tuple[_LoRALinear, int]], context: LoRAContext, *,
                 max_loras: int, max_rank: int, max_cpu_loras: int, device: torch.device, dtype: torch.dtype,
                 model_name: str = "", other_stage_layers: frozenset[int] = frozenset()) -> None:
        # (layer index, checkpoint projection) -> (wrapped layer, the projection's index in it)
        self.layers = layers
        # With pipeline parallelism, the decoder layers other stages hold: an adapter's matrices for them are
        # theirs to check and load, not a misfit here.
        self.other_stage_layers = other_stage_layers
        self.context = context
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.model_name = model_name  # named in the messages of adapters that do not fit
        self.slot_ids: list[int] = [0] * max_loras  # the adapter id in each slot (0: empty)
        self._slot_use: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))  # LRU first
        self.cpu_cache: OrderedDict[int, _CachedAdapter] = OrderedDict()
        self.num_slot_loads = 0

    @classmethod
    def wrap(cls, model: nn.Module, *, hidden_size: int, max_loras: int, max_rank: int, max_cpu_loras: int,
             device: torch.device, dtype: torch.dtype, model_name: str = "",
             other_stage_layers: frozenset[int] = frozenset()) -> "LoRAPool":
        context = LoRAContext()
        layers: dict[tuple[int, str], tuple[_LoRALinear, int]] = {}
        options = dict(max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device)
        for name, module in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            match = _LAYER_INDEX.search(name)
            if leaf not in WRAPPED_LAYERS or match is None:
                continue
            projections = WRAPPED_LAYERS[leaf]
            wrapped: _LoRALinear
            if isinstance(module, ColumnParallelLinear) and module.num_shards == len(projections):
                wrapped = ColumnParallelLoRA(module, context, projections=projections, **options)
            elif isinstance(module, RowParallelLinear) and len(projections) == 1:
                wrapped = RowParallelLoRA(module, context, projections=projections, out_features=hidden_size,
                                          **options)
            else:
                continue  # a plugin's layer of another shape: served without LoRA
            parent_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, wrapped)
            layer_index = int(match.group(1))
            for index, projection in enumerate(projections):
                layers[(layer_index, projection)] = (wrapped, index)
        if not layers:
            raise LoRAAdapterError(f"{type(model).__name__} has no attention or MLP projections LoRA can wrap "
                                   f"({', '.join(WRAPPED_LAYERS)}): it cannot serve adapters", field="enable_lora")
        return cls(layers, context, max_loras=max_loras, max_rank=max_rank, max_cpu_loras=max_cpu_loras,
                   device=device, dtype=dtype, model_name=model_name, other_stage_layers=other_stage_layers)

    # -- adapters in -------------------------------------------------------------------------------------

    def add(self, lora: LoRARequest) -> None:
        """Make sure `lora` is in the CPU cache (read and checked now); LoRAAdapterError when it is refused."""
        cached = self.cpu_cache.get(lora.lora_int_id)
        if cached is not None and cached.request.lora_path == lora.lora_path:
            self.cpu_cache.move_to_end(lora.lora_int_id)
            return
        self._cache(self._read(lora))

    def check(self, lora_name: str, lora_path: str) -> None:
        """Whether the adapter at `lora_path` fits this model: its config, and every matrix's shape from the
        safetensors header (no matrix is read, no slot or cache entry taken); LoRAAdapterError when not."""
        config = read_adapter_config(lora_path, max_rank=self.max_rank, name=lora_name)
        self._check_fit(lora_name, lora_path, config, read_adapter_shapes(lora_path, name=lora_name))

    def _read(self, lora: LoRARequest) -> _CachedAdapter:
        config = read_adapter_config(lora.lora_path, max_rank=self.max_rank, name=lora.lora_name)
        # The shapes from the header first: matrices read only once they fit, so their bytes are bounded
        # by the model's layers and max_lora_rank, whatever the file's size.
        self._check_fit(lora.lora_name, lora.lora_path, config,
                        read_adapter_shapes(lora.lora_path, name=lora.lora_name))
        weights = read_adapter_weights(lora.lora_path, name=lora.lora_name)
        self._check_fit(lora.lora_name, lora.lora_path, config,
                        {key: (tuple(a.shape), tuple(b.shape)) for key, (a, b) in weights.items()})
        return _CachedAdapter(lora, config, weights)

    def _check_fit(self, name: str, path: str, config: AdapterConfig, shapes: AdapterShapes) -> None:
        """Every (layer, projection) the adapter holds is one of this model's wrapped layers, with A [r, in]
        and B [out, r] at the checkpoint's (unsplit) sizes: the same on every tensor-parallel rank."""
        model = f"this model ({self.model_name})" if self.model_name else "this model"
        advice = "load an adapter trained for this base model"
        for (layer, projection), (a_shape, b_shape) in shapes.items():
            target = self.layers.get((layer, projection))
            label = f"LoRA adapter {name!r} ({path}): layer {layer} {projection}"
            if target is None and layer in self.other_stage_layers:
                continue  # another pipeline stage's layer: that stage checks it
            if target is None:
                layer_numbers = sorted({index for index, _ in self.layers})
                served = sorted({served for _, served in self.layers})
                raise LoRAAdapterError(
                    f"{label} is not a layer of {model}, which has LoRA layers {layer_numbers[0]}-{layer_numbers[-1]} "
                    f"on {', '.join(served)}: {advice}", field="target_modules")
            wrapped, index = target
            in_features, out_features = wrapped.expected_shapes(index)
            needed_a, needed_b = (config.rank, in_features), (out_features, config.rank)
            if tuple(a_shape) != needed_a or tuple(b_shape) != needed_b:
                raise LoRAAdapterError(
                    f"{label}: lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)} do not fit {model}, which needs "
                    f"lora_A {needed_a} and lora_B {needed_b} at r={config.rank}: {advice}", field="lora_path")

    def _cache(self, adapter: _CachedAdapter) -> None:
        self.cpu_cache[adapter.request.lora_int_id] = adapter
        self.cpu_cache.move_to_end(adapter.request.lora_int_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    # -- one step ----------------------------------------------------------------------------------------

    def begin_step(self, rows: Iterable[tuple[LoRARequest | None, int]]) -> None:
        """Give the layers this step's adapters: `rows` are (adapter or None, number of tokens), in batch order."""
        rows = list(rows)
        needed: dict[int, LoRARequest] = {}
        for lora, _ in rows:
            if lora is not None:
                needed.setdefault(lora.lora_int_id, lora)
        if not needed:
            self.context.step = None
            return
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} LoRA adapters, more than the {self.max_loras} slots "
                               "(max_loras): the scheduler must not schedule that")
        slot_of = {adapter_id: slot for slot, adapter_id in enumerate(self.slot_ids) if adapter_id in needed}
        for adapter_id, lora in needed.items():
            if adapter_id not in slot_of:
                slot_of[adapter_id] = self._load_slot(lora, busy=set(slot_of.values()))
        for slot in slot_of.values():
            self._slot_use.move_to_end(slot)
        order = list(needed)
        column_of = {adapter_id: column for column, adapter_id in enumerate(order)}
        lengths = np.fromiter((n for _, n in rows), dtype=np.int64, count=len(rows))
        columns = np.fromiter((-1 if lora is None else column_of[lora.lora_int_id] for lora, _ in rows),
                              dtype=np.int64, count=len(rows))
        slot_list = [slot_of[adapter_id] for adapter_id in order]
        onehot, token_slots = step_assignment(columns, lengths, slot_list)
        self.context.step = LoRAStep(slots=torch.tensor(slot_list, dtype=torch.int64).to(self.device),
                                     onehot=torch.from_numpy(onehot).to(device=self.device, dtype=self.dtype),
                                     token_slots=torch.from_numpy(token_slots).to(self.device))

    def end_step(self) -> None:
        self.context.step = None

    def _load_slot(self, lora: LoRARequest, *, busy: set[int]) -> int:
        slot = next((s for s in self._slot_use if self.slot_ids[s] == 0 and s not in busy), None)
        if slot is None:
            slot = next(s for s in self._slot_use if s not in busy)  # least recently used first
        adapter = self.cpu_cache.get(lora.lora_int_id)
        if adapter is None or adapter.request.lora_path != lora.lora_path:
            adapter = self._read(lora)  # dropped from the CPU cache since the request joined
            self._cache(adapter)
        else:
            self.cpu_cache.move_to_end(lora.lora_int_id)
        wrapped_layers = {wrapped for wrapped, _ in self.layers.values()}
        for wrapped in wrapped_layers:
            wrapped.clear_slot(slot)
        for (layer, projection), (a, b) in adapter.weights.items():
            if (layer, projection) not in self.layers:  # another pipeline stage's layer (checked by _check_fit)
                continue
            wrapped, index = self.layers[(layer, projection)]
            wrapped.set_projection(slot, index, a.to(self.device), b.to(self.device), adapter.config.scaling)
        self.slot_ids[slot] = lora.lora_int_id
        self.num_slot_loads += 1
        return slot

    # -- what it holds -----------------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes of the slot pool (fixed at wrap time by max_loras, max_lora_rank and the model)."""
        layers = {wrapped for wrapped, _ in self.layers.values()}
        return sum(t.numel() * t.element_size() for layer in layers for t in (layer.lora_a, layer.lora_b))

    def info(self) -> dict[str, Any]:
        return {"slots": list(self.slot_ids), "cpu_cache": list(self.cpu_cache), "pool_bytes": self.memory_bytes(),
                "slot_loads": self.num_slot_loads}


def step_assignment(columns: np.ndarray, lengths: np.ndarray, slot_list: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per token, from each request's active-adapter column (-1: the base model) and its number of tokens:
    the one-hot `[tokens, k]` of the torch path, and the slot of each token (-1: base) of the kernels."""
    token_columns = np.repeat(columns, lengths)
    used = token_columns >= 0
    onehot = np.zeros((len(token_columns), len(slot_list)), dtype=np.float32)
    onehot[np.nonzero(used)[0], token_columns[used]] = 1.0
    token_slots = np.where(used, np.asarray(slot_list, dtype=np.int64)[np.maximum(token_columns, 0)], -1)
    return onehot, token_slots.astype(np.int64)


__all__ = ["LoRAPool", "WRAPPED_LAYERS", "step_assignment"]
