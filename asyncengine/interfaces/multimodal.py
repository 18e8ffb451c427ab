"""SupportsMultiModal: what a vision-language model class offers the worker (vLLM's interface and names).

A multimodal model is the language model's class plus three things:
- the class flag `supports_multimodal = True` (the worker reads it, never isinstance on a base class);
- `embed_multimodal(**kwargs)`: the items' processor outputs (`pixel_values`, `image_grid_thw`, ... one
  entry per name, each a list with one tensor per item, in prompt order) -> one tensor of embeddings per item,
  `(num_embeddings, hidden_size)`, exactly as many rows as the item's placeholder positions that take one
  (`PlaceholderRange.is_embed`, all of them when None);
- `embed_input_ids(input_ids, multimodal_embeddings=None, *, is_multimodal=None)`: the token embeddings
  with the rows where `is_multimodal` is True replaced, in order, by the concatenated `multimodal_embeddings`;
  then `forward(input_ids, positions, metadata, inputs_embeds=...)` runs the language model on them (the
  Llama path's `LlamaModel.forward` takes `inputs_embeds`, and `LlamaModel.embed_input_ids` makes the token
  embeddings with the architecture's scale). The worker calls `embed_input_ids` and passes `inputs_embeds` only
  in steps that carry multimodal positions: a text-only step, and a text-only model, run as before.
  `positions` are whatever the model's forward reads: a (num_tokens,) tensor, or M-RoPE's (3, num_tokens) for
  a model that sets `supports_mrope = True` (vLLM's SupportsMRoPE) and gives vLLM's
  `get_mrope_input_positions(input_tokens, mm_features) -> (positions (3, num_prompt_tokens) int64 tensor, mrope_position_delta: int)` (the Qwen-VL family): the worker
  calls it once per prompt, slices it per chunk, and after the prompt gives every token the position
  `index + mrope_position_delta` on all three rows. `mm_features` are the request's MultiModalFeatures
  (asyncengine/wire/multimodal.py; `asyncengine.wire.tensors.tensor_from_wire` reads their data).
- classmethod `get_placeholder_str(modality, i)`: the text a chat template puts for the i-th item (the
  frontend's business).

vLLM's older names, `get_multimodal_embeddings` and `get_input_embeddings`, are accepted for ported plugins:
`embed_multimodal_of` and `embed_input_ids_of` call whichever the class has. `merge_multimodal_embeddings` is
the default merge a model's `embed_input_ids` may use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:  # the floor loads no torch (tests/test_interfaces.py): only the functions below use it
    import torch

# What embed_multimodal returns: one (num_embeddings, hidden_size) tensor per item (a list, a tuple, or one
# stacked tensor whose first dimension is the items).
MultiModalEmbeddings: TypeAlias = "Sequence[torch.Tensor] | torch.Tensor"


@runtime_checkable
class SupportsMultiModal(Protocol):
    """vLLM's `SupportsMultiModal` (vllm/model_executor/models/interfaces.py): see the module's docstring."""

    supports_multimodal: ClassVar[Literal[True]]

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None: ...

    def embed_multimodal(self, **kwargs: object) -> MultiModalEmbeddings: ...

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings | None = None,
                        *, is_multimodal: torch.Tensor | None = None) -> torch.Tensor: ...


def supports_multimodal(model: object) -> bool:
    """True for a multimodal model class or instance (vLLM's check: the class flag)."""
    return getattr(model, "supports_multimodal", False) is True


def embed_multimodal_of(model: Any, **kwargs: object) -> list[torch.Tensor]:
    """`model.embed_multimodal(**kwargs)`, or the older `get_multimodal_embeddings`, as a list of tensors."""
    method = getattr(model, "embed_multimodal", None) or getattr(model, "get_multimodal_embeddings", None)
    if method is None:
        raise TypeError(f"{type(model).__qualname__} sets supports_multimodal but has neither embed_multimodal(**kwargs) "
                        "nor get_multimodal_embeddings(**kwargs): implement embed_multimodal "
                        "(asyncengine.interfaces.multimodal.SupportsMultiModal)")
    embeddings = method(**kwargs)
    if embeddings is None:
        return []
    return list(embeddings)


def embed_input_ids_of(model: Any, input_ids: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings | None,
                       is_multimodal: torch.Tensor | None) -> torch.Tensor:
    """`model.embed_input_ids(...)`, or the older `get_input_embeddings(...)` (same arguments)."""
    method = getattr(model, "embed_input_ids", None) or getattr(model, "get_input_embeddings", None)
    if method is None or not callable(method):
        raise TypeError(f"{type(model).__qualname__} sets supports_multimodal but has no embed_input_ids(input_ids, "
                        "multimodal_embeddings, *, is_multimodal): implement it "
                        "(asyncengine.interfaces.multimodal.SupportsMultiModal)")
    return method(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)


def merge_multimodal_embeddings(inputs_embeds: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings | None,
                                is_multimodal: torch.Tensor | None) -> torch.Tensor:
    """Put the rows of `multimodal_embeddings` (concatenated in order) where `is_multimodal` is True.

    The counts must agree: a mismatch is a processor/model disagreement, reported with both numbers."""
    if multimodal_embeddings is None or is_multimodal is None:
        return inputs_embeds
    items = list(multimodal_embeddings)
    if not items:
        return inputs_embeds
    hidden_size = inputs_embeds.shape[-1]
    rows = [item.reshape(-1, hidden_size) for item in items]
    num_rows = sum(int(item.shape[0]) for item in rows)
    positions = is_multimodal.nonzero().flatten()  # (tensor methods only: the floor imports no torch)
    if num_rows != positions.shape[0]:
        raise ValueError(f"{num_rows} multimodal embeddings for {positions.shape[0]} placeholder positions: the "
                         "model's embed_multimodal and the processor's placeholder expansion disagree")
    inputs_embeds = inputs_embeds.clone()
    start = 0
    for item in rows:
        inputs_embeds[positions[start:start + item.shape[0]]] = item.to(inputs_embeds.dtype)
        start += item.shape[0]
    return inputs_embeds


def num_embeds(feature: Any) -> int:
    """How many embedding rows the model makes for one MultiModalFeature (asyncengine/wire/multimodal.py): its
    placeholder positions that take one (vLLM's PlaceholderRange.get_num_embeds)."""
    is_embed = feature.position.is_embed
    return int(feature.position.length if is_embed is None else sum(is_embed))
