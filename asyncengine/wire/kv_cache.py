"""The KV cache's layout: which attention layers share block tables (KV cache groups), and how they share memory.

A model whose layers all attend over the whole context has one group: every layer uses the sequence's one
block table, and a block holds `block_size` tokens of every layer (the layout before sliding windows).

A model with sliding-window layers (Mistral's, Gemma 2's every other layer, Gemma 3's five of six) keeps, for
those layers, only the blocks of the last `sliding_window` tokens: blocks leaving the window go back to the
free pool while the sequence runs (the block manager frees them, engine_core/block_manager.py), where a
full-length cache with a mask would keep them all. Layers are grouped by attention type, each group with
its own block table per sequence, as vLLM's hybrid KV cache manager does:

- every group has the same number of layers (`num_slots`, the smallest type's count), so the smaller types'
  layers stand alone and the larger ones split into several groups (Gemma 3's 15 sliding and 3 full layers:
  five sliding groups and one full group of 3); a group may have fewer layers than slots (the rest of its
  memory then idles);
- the memory is `num_slots` tensors of `num_blocks` pages each; slot `j` is used by the `j`-th layer of
  every group; a block id belongs to one group at a time (to one layer of each slot), so all groups draw
  blocks from one pool: the blocks a window frees serve the full layers' growth and other sequences alike.

Built in the engine core from the workers' answers (`kv_cache_spec`: each rank's attention layers and their
windows) and sent back to them (`initialize_kv_cache`); a msgspec Struct, as it crosses to worker processes.
"""

from __future__ import annotations

import msgspec

# Where a sliding group's freed blocks stood in a sequence's block table: a block never handed out (block 0,
# reserved when a layout has a sliding group), so a kernel that reads a table entry before the window (the
# torch reference gathers whole tables) reads zeros, never another sequence's live block.
NULL_BLOCK = 0


class KVCacheGroup(msgspec.Struct, frozen=True):
    layers: list[int]  # the attention layers (in the model's order), one per memory slot from slot 0
    sliding_window: int | None = None  # None: full attention; else each query sees its last N keys


class KVCacheLayout(msgspec.Struct, frozen=True):
    groups: list[KVCacheGroup]

    @property
    def num_slots(self) -> int:
        return max((len(group.layers) for group in self.groups), default=0)

    @property
    def sliding_windows(self) -> list[int | None]:
        return [group.sliding_window for group in self.groups]

    @property
    def has_sliding_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    def placement(self) -> dict[int, tuple[int, int]]:
        """Layer -> (its group, its memory slot)."""
        return {layer: (index, slot) for index, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}


def build_layout(layer_windows: dict[int, int | None]) -> KVCacheLayout:
    """The layout for attention layers with these sliding windows (None: full attention).

    One group of every layer when none slides (or the model has no attention layers); else one group per
    `num_slots` layers of a type, `num_slots` being the smallest type's layer count, full attention first,
    then the windows from the smallest."""
    if all(window is None for window in layer_windows.values()):
        return KVCacheLayout([KVCacheGroup(sorted(layer_windows))])
    by_window: dict[int | None, list[int]] = {}
    for layer in sorted(layer_windows):
        by_window.setdefault(layer_windows[layer], []).append(layer)
    num_slots = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: -1 if w is None else w):
        layers = by_window[window]
        groups += [KVCacheGroup(layers[start:start + num_slots], window) for start in range(0, len(layers), num_slots)]
    return KVCacheLayout(groups)


def single_group(num_layers: int) -> KVCacheLayout:
    """Every layer in one full-attention group (what a model without sliding windows has)."""
    return KVCacheLayout([KVCacheGroup(list(range(num_layers)))])
