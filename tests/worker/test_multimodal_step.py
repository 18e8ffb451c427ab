"""The worker's multimodal step (worker/multimodal.py) on a stand-in model: which rows land where when a chunk
starts or ends inside an image's span and text tokens sit inside it (is_embed), the encoder cache's frees before
computes, one encoder run for two requests with one image, vLLM's older method names, and the errors that name
a model/processor disagreement. TensorData <-> torch round trips (wire/tensors.py)."""

from __future__ import annotations

import pytest
import torch

from asyncengine.interfaces.multimodal import merge_multimodal_embeddings
from asyncengine.wire.multimodal import MultiModalFeature, PlaceholderRange
from asyncengine.wire.tensors import tensor_from_wire, tensor_to_wire
from asyncengine.wire.worker import SchedulerOutput
from asyncengine.worker.multimodal import MultiModalStep

HIDDEN = 3


class StandIn:
    """embed_multimodal: item i's rows are `value * 100 + row` (its `value` tensor); token embeddings: -id."""

    supports_multimodal = True

    def __init__(self) -> None:
        self.calls: list[int] = []

    def embed_multimodal(self, **kwargs):
        self.calls.append(len(kwargs["value"]))
        return [float(v.item()) * 100 + torch.arange(int(n.item()), dtype=torch.float32)[:, None].expand(-1, HIDDEN)
                for v, n in zip(kwargs["value"], kwargs["rows"])]

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        embeds = -input_ids.to(torch.float32)[:, None].expand(-1, HIDDEN)
        return merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)


class OldNames:
    """A ported plugin with vLLM's older names."""

    supports_multimodal = True

    def get_multimodal_embeddings(self, **kwargs):
        return [torch.full((int(n.item()), HIDDEN), 7.0) for n in kwargs["rows"]]

    def get_input_embeddings(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        return merge_multimodal_embeddings(torch.zeros(input_ids.shape[0], HIDDEN), multimodal_embeddings,
                                           is_multimodal)


def item(identifier: str, value: int, offset: int, is_embed: list[bool] | None, length: int | None = None):
    length = len(is_embed) if is_embed is not None else length
    rows = sum(is_embed) if is_embed is not None else length
    return MultiModalFeature(modality="image", identifier=identifier,
                             position=PlaceholderRange(offset=offset, length=length, is_embed=is_embed),
                             data={"value": tensor_to_wire(torch.tensor([value])),
                                   "rows": tensor_to_wire(torch.tensor([rows]))})


def test_rows_land_on_their_positions_across_a_split_span_with_text_inside():
    model = StandIn()
    step = MultiModalStep(model, torch.device("cpu"))
    # Positions 2..7: embed, embed, text, embed, text, embed -> rows 0, 1, -, 2, -, 3.
    feature = item("A", 1, 2, [True, True, False, True, False, True])
    features = {"r": [feature]}
    step.run_encoders(SchedulerOutput(scheduled_encoder_inputs={"r": [0]}), features)
    ids = torch.arange(10, 15)  # the chunk: positions 4..8
    embeds = step.inputs_embeds({"r": 5}, {"r": 4}, features, ids)
    assert embeds is not None
    # pos 4 text (in the span), 5 row 2, 6 text, 7 row 3, 8 after the span.
    assert embeds[:, 0].tolist() == [-10.0, 102.0, -12.0, 103.0, -14.0]
    # A chunk wholly outside any span: no merge, the text path.
    assert step.inputs_embeds({"r": 2}, {"r": 8}, features, torch.arange(2)) is None


def test_frees_come_before_computes_and_one_image_runs_once_for_two_requests():
    model = StandIn()
    step = MultiModalStep(model, torch.device("cpu"))
    features = {"a": [item("X", 2, 0, None, 4)], "b": [item("X", 2, 1, None, 4)]}
    step.run_encoders(SchedulerOutput(scheduled_encoder_inputs={"a": [0], "b": [0]}), features)
    assert model.calls == [1] and set(step.cache) == {"X"}
    step.run_encoders(SchedulerOutput(free_encoder_mm_hashes=["X"], scheduled_encoder_inputs={"a": [0]}), features)
    assert model.calls == [1, 1] and set(step.cache) == {"X"}
    step.run_encoders(SchedulerOutput(free_encoder_mm_hashes=["X"]), features)
    assert step.cache == {}


def test_older_vllm_names_work():
    step = MultiModalStep(OldNames(), torch.device("cpu"))
    features = {"r": [item("Y", 0, 1, None, 2)]}
    step.run_encoders(SchedulerOutput(scheduled_encoder_inputs={"r": [0]}), features)
    embeds = step.inputs_embeds({"r": 4}, {"r": 0}, features, torch.arange(4))
    assert embeds is not None and embeds[:, 0].tolist() == [0.0, 7.0, 7.0, 0.0]


def test_a_row_count_the_placeholder_does_not_take_is_named():
    class Wrong(StandIn):
        def embed_multimodal(self, **kwargs):
            return [torch.zeros(5, HIDDEN)]

    step = MultiModalStep(Wrong(), torch.device("cpu"))
    with pytest.raises(ValueError, match="made 5 rows for an item whose placeholder takes 4"):
        step.run_encoders(SchedulerOutput(scheduled_encoder_inputs={"r": [0]}), {"r": [item("Z", 0, 0, None, 4)]})


@pytest.mark.parametrize("tensor", [torch.randn(2, 3, dtype=torch.bfloat16), torch.arange(6).reshape(3, 2),
                                    torch.rand(1, 2, 3) > 0.5, torch.zeros(0, 4)])
def test_tensor_data_round_trips(tensor):
    back = tensor_from_wire(tensor_to_wire(tensor))
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_tensor_data_that_does_not_add_up_is_refused():
    data = tensor_to_wire(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="needs 16 bytes, got 12"):
        tensor_from_wire(type(data)(dtype="float32", shape=[2, 2], data=data.data[:12]))
    with pytest.raises(ValueError, match="not a torch dtype"):
        tensor_from_wire(type(data)(dtype="nope", shape=[1], data=b"\0" * 4))


def test_mrope_positions_slice_the_prompt_and_add_the_delta_after_it():
    from types import SimpleNamespace

    from asyncengine.worker.multimodal import mrope_positions

    class MRoPE:
        supports_mrope = True
        asked = 0

        def get_mrope_input_positions(self, input_tokens, mm_features):
            MRoPE.asked += 1
            base = torch.arange(len(input_tokens))
            return torch.stack([base, base * 10, base * 100]), -2  # an image shortens the positions after it

    state = SimpleNamespace(prompt_token_ids=[1, 2, 3, 4], mm_features=None, mrope=None)
    model = MRoPE()
    chunk = mrope_positions(model, {"r": 3}, {"r": 2}, {"r": state})  # prompt tokens 2, 3, then token 4
    assert chunk.tolist() == [[2, 3, 2], [20, 30, 2], [200, 300, 2]]
    decode = mrope_positions(model, {"r": 1}, {"r": 5}, {"r": state})
    assert decode.tolist() == [[3], [3], [3]] and MRoPE.asked == 1


def test_malformed_items_are_named_before_they_reach_a_step():
    from asyncengine.wire.multimodal import TensorData
    from asyncengine.worker.multimodal import check_features

    good = item("G", 1, 2, None, 4)
    assert check_features([good], 6) is None
    assert "not inside the prompt of 5 tokens" in check_features([good], 5)
    bad_mask = MultiModalFeature(modality="image", identifier="M",
                                 position=PlaceholderRange(offset=0, length=3, is_embed=[True]), data={})
    assert "is_embed has 1 entries for a span of 3" in check_features([bad_mask], 6)
    bad_tensor = MultiModalFeature(modality="image", identifier="T", position=PlaceholderRange(offset=0, length=1),
                                   data={"pixel_values": TensorData(dtype="float32", shape=[2], data=b"1234")})
    assert "'pixel_values': tensor of shape [2] and dtype float32 needs 8 bytes, got 4" in check_features([bad_tensor], 6)


def test_an_item_whose_scheduled_run_was_lost_is_computed_where_it_is_read():
    # The request scheduled to compute X failed in this worker; another request of the step reads X.
    model = StandIn()
    step = MultiModalStep(model, torch.device("cpu"))
    features = {"b": [item("X", 3, 0, None, 2)]}
    step.run_encoders(SchedulerOutput(scheduled_encoder_inputs={"a": [0]}), features)  # "a" is gone
    embeds = step.inputs_embeds({"b": 2}, {"b": 0}, features, torch.arange(2))
    assert embeds is not None and embeds[:, 0].tolist() == [300.0, 301.0] and model.calls == [1]
