"""The worker's side of multimodal requests: the encoder cache, the vision tower's runs, the merge.

Each step, before the forward pass (`MultiModalStep.run_encoders`): the identifiers the scheduler freed are
dropped, then the items it scheduled (`scheduled_encoder_inputs`) go through the model's `embed_multimodal`,
grouped by modality and processor outputs so one call takes several images, and their embeddings are kept
under their identifiers until the scheduler frees them (engine_core/encoder_cache.py keeps the books). Then
`inputs_embeds` builds the step's first-layer input: for every scheduled token inside an item's span that takes
an embedding (`is_embed`), the item's row for that position, sliced from the cache (a chunk may start or end
inside the span), merged by the model's `embed_input_ids`. A step with no such token returns None and the
forward pass runs from token ids as for a text-only model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncengine.interfaces.multimodal import embed_input_ids_of, embed_multimodal_of, num_embeds
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.wire.tensors import check_tensor_data, tensor_from_wire
from asyncengine.wire.worker import SchedulerOutput


def feature_kwargs(features: Sequence[MultiModalFeature], device: torch.device) -> dict[str, list[torch.Tensor]]:
    """The keyword arguments of `embed_multimodal` for these items: per processor-output name, one tensor per
    item in the items' order, on `device` (each keeps the batch dimension of 1 the processor gave it)."""
    names = list(dict.fromkeys(name for feature in features for name in feature.data))
    kwargs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for feature in features:
        for name in names:
            if name not in feature.data:
                raise ValueError(f"multimodal item {feature.identifier[:16]} lacks {name!r}, which other items of "
                                 "its group carry")
            kwargs[name].append(tensor_from_wire(feature.data[name]).to(device))
    return kwargs


def check_features(features: Sequence[MultiModalFeature], num_prompt_tokens: int) -> str | None:
    """Why these items cannot run with a prompt of `num_prompt_tokens` (None: they can): a span outside the prompt,
    an `is_embed` of another length, tensors whose dtype, shape and bytes disagree. Checked when the request joins
    the worker, so a malformed item fails its request alone, never the step."""
    for index, feature in enumerate(features):
        position = feature.position
        if position.offset < 0 or position.length <= 0 or position.offset + position.length > num_prompt_tokens:
            return (f"item {index}'s placeholder span [{position.offset}, {position.offset + position.length}) is "
                    f"not inside the prompt of {num_prompt_tokens} tokens")
        if position.is_embed is not None and len(position.is_embed) != position.length:
            return f"item {index}'s is_embed has {len(position.is_embed)} entries for a span of {position.length}"
        for name, data in feature.data.items():
            try:
                check_tensor_data(data)
            except ValueError as exc:
                return f"item {index}'s {name!r}: {exc}"
    return None


class MultiModalStep:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}  # identifier -> (num_embeds, hidden) embeddings

    def run_encoders(self, scheduler_output: SchedulerOutput, features_of: Mapping[str, list[MultiModalFeature]]) -> None:
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.cache.pop(identifier, None)
        if not scheduler_output.scheduled_encoder_inputs:
            return
        groups: dict[tuple[str, tuple[str, ...]], list[MultiModalFeature]] = {}
        for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            features = features_of.get(request_id)
            if features is None:
                continue  # failed in this worker (its state is gone): nothing reads its images
            for index in indices:
                feature = features[index]
                if feature.identifier in self.cache:
                    continue  # two requests of this step with one image: computed once
                key = (feature.modality, tuple(sorted(feature.data)))
                group = groups.setdefault(key, [])
                if all(item.identifier != feature.identifier for item in group):
                    group.append(feature)
        for group in groups.values():
            self._encode(group)

    def _encode(self, group: list[MultiModalFeature]) -> None:
        """The model's vision part on items of one modality and one set of processor outputs, into the cache."""
        embeddings = embed_multimodal_of(self.model, **feature_kwargs(group, self.device))
        if len(embeddings) != len(group):
            raise ValueError(f"{type(self.model).__qualname__}.embed_multimodal returned {len(embeddings)} "
                             f"embeddings for {len(group)} items: it must return one tensor per item")
        for feature, rows in zip(group, embeddings):
            rows = rows.reshape(-1, rows.shape[-1])
            if rows.shape[0] != num_embeds(feature):
                raise ValueError(f"{type(self.model).__qualname__}.embed_multimodal made {rows.shape[0]} rows for "
                                 f"an item whose placeholder takes {num_embeds(feature)}: the model and the "
                                 "processor's placeholder expansion disagree")
            self.cache[feature.identifier] = rows

    def inputs_embeds(self, scheduled: Mapping[str, int], computed: Mapping[str, int],
                      features_of: Mapping[str, list[MultiModalFeature]], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's first-layer input with the items' rows merged, or None when no scheduled token takes one.
        `scheduled`: request id -> tokens this step (batch order); `computed`: their tokens computed before it."""
        rows: list[torch.Tensor] = []
        positions: list[np.ndarray] = []
        batch_offset = 0
        for request_id, num_tokens in scheduled.items():
            features = features_of.get(request_id)
            start = computed.get(request_id, 0)
            end = start + num_tokens
            for feature in features or ():
                offset, length = feature.position.offset, feature.position.length
                lo, hi = max(start, offset) - offset, min(end, offset + length) - offset  # in the span
                if lo >= hi:
                    continue
                cached = self.cache.get(feature.identifier)
                if cached is None:  # the request scheduled to compute it failed in this worker: this one does
                    self._encode([feature])
                    cached = self.cache[feature.identifier]
                in_span = np.arange(lo, hi)
                is_embed = feature.position.is_embed
                if is_embed is not None:
                    mask = np.asarray(is_embed, dtype=bool)
                    row_of = np.cumsum(mask) - 1
                    in_span = in_span[mask[lo:hi]]
                    if in_span.size == 0:
                        continue
                    rows.append(cached[torch.from_numpy(row_of[in_span]).to(cached.device)])
                else:
                    rows.append(cached[lo:hi])
                positions.append(batch_offset + offset - start + in_span)
            batch_offset += num_tokens
        if not rows:
            return None
        is_multimodal = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        is_multimodal[torch.from_numpy(np.concatenate(positions))] = True
        return embed_input_ids_of(self.model, input_ids, rows, is_multimodal.to(input_ids.device))

    def clear(self) -> None:
        self.cache.clear()


def uses_mrope(model: Any) -> bool:
    """A model with M-RoPE (3-D positions: the Qwen-VL family): vLLM's SupportsMRoPE flag, `supports_mrope`."""
    return getattr(model, "supports_mrope", False) is True


def mrope_positions(model: Any, scheduled: Mapping[str, int], computed: Mapping[str, int],
                    requests: Mapping[str, Any]) -> torch.Tensor:
    """The step's (3, num_tokens) M-RoPE positions, batch order: a prompt token's from the model's
    `get_mrope_input_positions(prompt_token_ids, mm_features)` (asked once per request, kept on its state as
    `mrope`), a later token's its index plus the request's delta on all three rows."""
    columns: list[torch.Tensor] = []
    for request_id, num_tokens in scheduled.items():
        state = requests[request_id]
        if state.mrope is None:
            positions, delta = model.get_mrope_input_positions(list(state.prompt_token_ids),
                                                               list(state.mm_features or ()))
            positions = torch.as_tensor(positions, dtype=torch.int64).reshape(3, -1)
            if positions.shape[1] != len(state.prompt_token_ids):
                raise ValueError(f"{type(model).__qualname__}.get_mrope_input_positions gave {positions.shape[1]} "
                                 f"positions for a prompt of {len(state.prompt_token_ids)} tokens")
            state.mrope = (positions, int(delta))
        prompt_positions, delta = state.mrope
        start = computed[request_id]
        end = start + num_tokens
        num_prompt = prompt_positions.shape[1]
        part = [prompt_positions[:, start:min(end, num_prompt)]]
        if end > num_prompt:
            later = torch.arange(max(start, num_prompt), end, dtype=torch.int64) + delta
            part.append(later.expand(3, -1))
        columns.extend(part)
    return torch.cat(columns, dim=1)
