"""The worker's KV cache memory, laid out as the engine core's KV cache layout says (asyncengine/wire/kv_cache.py).

With one group (no sliding-window layers) every attention layer has its own pair of tensors
`[num_kv_heads, num_blocks, block_size, head_dim]`, as always. With several groups, memory slot `j` is one pair
of such tensors, shared by the `j`-th layer of every group (a block id is in one group at a time, so the layers
sharing a slot never hold the same block): this rank allocates the slots its layers use, and a block costs
`slots x` one layer's page instead of `layers x`.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.errors import StartupError
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.wire.kv_cache import KVCacheGroup, KVCacheLayout


def layer_indices(layers: list[PagedAttention]) -> list[int]:
    """Each attention layer's index in the model: its own `layer_index` (ours set it: with pipeline parallelism
    a stage's layers do not start at 0), else its place among this rank's attention layers."""
    return [index if layer.layer_index is None else layer.layer_index for index, layer in enumerate(layers)]


def layer_spec(layers: list[PagedAttention]) -> list[list[int | None]]:
    """`[layer index, sliding window or None]` for each attention layer of this rank (the engine core's input)."""
    return [[index, getattr(layer, "sliding_window", None)] for index, layer in zip(layer_indices(layers), layers)]


def local_layout(layers: list[PagedAttention]) -> KVCacheLayout:
    """One group of every layer: the layout of a rank the engine core gave none (a runner built by hand)."""
    return KVCacheLayout([KVCacheGroup(layer_indices(layers))])


def apply_layout(layers: list[PagedAttention], layout: KVCacheLayout) -> dict[int, int]:
    """Set each layer's KV cache group from the layout; returns layer position -> memory slot. A layer the
    layout lacks, or whose window differs from its group's, is the engine core's mistake: named here."""
    placement = layout.placement()
    slots = {}
    for position, (index, layer) in enumerate(zip(layer_indices(layers), layers)):
        if index not in placement:
            raise StartupError(f"the KV cache layout has no group for attention layer {index}")
        group, slot = placement[index]
        window = layout.groups[group].sliding_window
        if window != getattr(layer, "sliding_window", None):
            raise StartupError(f"attention layer {index} has sliding window {layer.sliding_window}, but the KV cache "
                               f"layout puts it in a group with window {window}")
        layer.kv_cache_group = group
        slots[position] = slot
    if len(layout.groups) > 1:
        shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
        if len(shapes) > 1:
            raise StartupError("a model with sliding-window layers shares KV cache memory between its groups, which "
                               "needs every attention layer to have the same KV heads and head size; this one has "
                               f"{sorted(shapes)}")
    return slots


def bytes_per_block(layers: list[PagedAttention], layout: KVCacheLayout, block_size: int, dtype: torch.dtype) -> int:
    """KV cache bytes one block costs on this rank."""
    element_size = torch.empty((), dtype=dtype).element_size()
    pages = [2 * block_size * layer.num_kv_heads * layer.head_dim * element_size for layer in layers]
    if len(layout.groups) == 1:
        return sum(pages)
    slots = apply_layout(layers, layout)
    return len(set(slots.values())) * (pages[0] if pages else 0)


def allocate(layers: list[PagedAttention], layout: KVCacheLayout, num_blocks: int, block_size: int,
             dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Bind each layer's cache; returns the distinct tensor pairs (one per layer, or per memory slot)."""
    def pair(layer: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (layer.num_kv_heads, num_blocks, block_size, layer.head_dim)
        # Zeroed, not empty: padded attention reads stale slots (masked out), and a NaN there
        # would still poison the result through 0 * NaN.
        return (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    if len(layout.groups) == 1:
        for layer in layers:
            layer.kv_cache_group = 0
            layer.kv_cache = pair(layer)
            caches.append(layer.kv_cache)
        return caches
    by_slot: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for position, slot in apply_layout(layers, layout).items():
        if slot not in by_slot:
            by_slot[slot] = pair(layers[position])
            caches.append(by_slot[slot])
        layers[position].kv_cache = by_slot[slot]
    return caches


def blocks_for_one_sequence(layout: KVCacheLayout | None, max_len: int, block_size: int, step_tokens: int) -> int:
    """The blocks one sequence of `max_len` tokens may hold at once: every block of each full group; in a sliding
    group, its window's and one step's (a step's tokens take their blocks before the window moves on: vLLM's
    `cdiv(window - 1 + step tokens, block size) + 1`); and the reserved null block."""
    whole = -(-max_len // block_size)
    if layout is None or len(layout.groups) == 1 and layout.groups[0].sliding_window is None:
        return whole
    needed = 0
    for group in layout.groups:
        window = group.sliding_window
        needed += whole if window is None else min(whole, -(-(window - 1 + step_tokens) // block_size) + 1)
    return needed + int(layout.has_sliding_window)


def group_metadata(tables: np.ndarray, token_seqs: np.ndarray, positions: np.ndarray, first: AttentionMetadata,
                   device: torch.device) -> AttentionMetadata:
    """A KV cache group's metadata for a step: its slots and block tables (`tables`, `[seqs, width]`, the group's
    rows of the step's sequences), the rest the first group's (`first`)."""
    block_size = first.block_size
    if block_size is None:
        raise RuntimeError("group_metadata needs the first group's metadata built with block_size")
    slots = tables[token_seqs, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        torch.from_numpy(slots).to(device), None, first.query_lens, first.seq_lens,
        torch.from_numpy(np.ascontiguousarray(tables)).to(device), block_size=block_size,
        query_start_loc=first.query_start_loc, seq_lens_tensor=first.seq_lens_tensor,
        max_query_len=first.max_query_len, max_seq_len=first.max_seq_len, decode_only=first.decode_only)
