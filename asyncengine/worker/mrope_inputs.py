"""The model runner's M-RoPE positions (asyncengine/models/layers/mrope.py) for models that declare
`supports_mrope` (the Qwen2-VL family): `[3, tokens]` positions in place of the flat ones.

When a request joins, its prompt's three positions per token and its delta are computed once from its length
and its images' places and `image_grid_thw` (the model's `get_mrope_input_positions`, vLLM's name; images
that do not fit the prompt fail only that request, in `ModelRunner._admit`); each step then
reads the rows of its scheduled tokens: a prompt token's from that table, a generated token's (index >= the
prompt's length) its index plus the delta on all three axes. A preempted request that comes back is added
again (same prompt, same table). The flat positions stay what the KV cache's slots are computed from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncengine.wire.multimodal import MultiModalFeature


class MRopePositions:
    """Per request: its prompt's `[3, prompt_len]` positions and its delta."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.prompts: dict[str, tuple[np.ndarray, int]] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int],
            mm_features: Sequence[MultiModalFeature] | None) -> None:
        positions, delta = self.model.get_mrope_input_positions(list(prompt_token_ids), mm_features)
        self.prompts[request_id] = (positions.numpy(), int(delta))

    def remove(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)

    def step(self, request_ids: Sequence[str], starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """`[3, total]` int64 positions of the step's tokens: request i's `lengths[i]` tokens from `starts[i]`."""
        out = np.empty((3, int(lengths.sum())), dtype=np.int64)
        offset = 0
        for request_id, start, length in zip(request_ids, starts.tolist(), lengths.tolist()):
            table, delta = self.prompts[request_id]
            end = start + length
            in_prompt = max(0, min(end, table.shape[1]) - start)
            out[:, offset:offset + in_prompt] = table[:, start:start + in_prompt]
            out[:, offset + in_prompt:offset + length] = np.arange(start + in_prompt, end) + delta
            offset += length
        return out
