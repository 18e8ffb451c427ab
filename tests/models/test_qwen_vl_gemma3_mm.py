"""Qwen2-VL, Qwen2.5-VL and Gemma 3 (image + text) at the model level: our modules' logits against transformers'
for the same prompt with 1 and 2 images of different sizes, processed by the real image processors (float32,
tiny random models of tests/support/vl_models.py). Tolerance: 1e-4 absolute on logits of magnitude ~1-10
(float32 sums in another order: our fused QKV, paged attention, the patch embedding as a matmul).
M-RoPE's positions are checked against transformers' get_rope_index."""

from __future__ import annotations

import pytest
import torch

from asyncengine.models.layers.mrope import mrope_positions
from support import vl_models as vl
from support.platforms import use_platform

pytest.importorskip("PIL")

ATOL = 1e-4


@pytest.fixture(scope="module")
def cpu_platform():
    """The CPU platform as if resolved at start-up, for the module (the ops dispatch on it)."""
    from asyncengine.models.layers import op_registry
    from asyncengine.platforms.cpu import CpuPlatform

    with pytest.MonkeyPatch.context() as patch:
        use_platform(patch, CpuPlatform)
        patch.setattr(op_registry, "_chains", {})
        yield CpuPlatform


@pytest.fixture(scope="module")
def qwen_models(cpu_platform):
    from transformers import Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

    from asyncengine.models.qwen2_vl import Qwen2VLForConditionalGeneration as Ours2
    from asyncengine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Ours25

    torch.manual_seed(0)
    built = {}
    for name, config, hf_cls, ours_cls in (("qwen2_vl", vl.qwen2_vl_config(), Qwen2VLForConditionalGeneration, Ours2),
                                           ("qwen2_5_vl", vl.qwen2_5_vl_config(), Qwen2_5_VLForConditionalGeneration,
                                            Ours25)):
        config._attn_implementation = "eager"
        hf = hf_cls(config).eval()
        built[name] = (hf, vl.ours_from(hf, ours_cls))
    return built


def _qwen_inputs(num_images: int):
    processor = vl.qwen_image_processor("qwen2_vl")
    images = vl.two_images()[:num_images]
    processed = processor(images=images, return_tensors="pt")
    grids = processed["image_grid_thw"].tolist()
    text = [[5, 6, 7], [8, 9], [10, 11, 12, 13]][:num_images + 1]
    return processed, grids, vl.qwen_prompt(grids, text)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("num_images", [1, 2])
def test_qwen_vl_logits_match_transformers(qwen_models, name, num_images):
    hf, ours = qwen_models[name]
    processed, grids, ids = _qwen_inputs(num_images)
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        expected = hf(input_ids=input_ids, pixel_values=processed["pixel_values"],
                      image_grid_thw=processed["image_grid_thw"],
                      mm_token_type_ids=(input_ids == vl.IMAGE_TOKEN).int()).logits[0].float()
        offsets = [i for i, token in enumerate(ids) if token == vl.IMAGE_TOKEN and ids[i - 1] == vl.VISION_START]
        positions, delta = mrope_positions(len(ids), list(zip(offsets, grids)), spatial_merge_size=2)
        hf_positions, hf_delta = hf.model.get_rope_index(input_ids, (input_ids == vl.IMAGE_TOKEN).int(),
                                                         image_grid_thw=processed["image_grid_thw"])
        assert torch.equal(positions, hf_positions[:, 0]) and delta == int(hf_delta)
        per_image = [processed["pixel_values"][start:start + t * h * w] for (t, h, w), start in
                     zip(grids, [0, grids[0][0] * grids[0][1] * grids[0][2]])]
        embeddings = ours.model.embed_multimodal(pixel_values=per_image,
                                                 image_grid_thw=[torch.tensor([g]) for g in grids])
        assert [e.shape[0] for e in embeddings] == [t * h * w // 4 for t, h, w in grids]
        token_ids = torch.tensor(ids)
        inputs_embeds = ours.model.embed_input_ids(token_ids, embeddings, is_multimodal=token_ids == vl.IMAGE_TOKEN)
    logits = ours.prefill(ids, positions, inputs_embeds)
    assert grids[0] != grids[-1] or num_images == 1
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def gemma3_models(cpu_platform):
    from transformers import Gemma3ForConditionalGeneration

    from asyncengine.models.gemma3_mm import Gemma3ForConditionalGeneration as Ours

    torch.manual_seed(0)
    config = vl.gemma3_config()
    config._attn_implementation = "eager"
    hf = Gemma3ForConditionalGeneration(config).eval()
    return hf, vl.ours_from(hf, Ours)


@pytest.mark.parametrize("num_images", [1, 2])
def test_gemma3_logits_match_transformers_with_image_tokens_seeing_their_image(gemma3_models, num_images):
    hf, ours = gemma3_models
    pixel_values = vl.gemma3_image_processor()(images=vl.two_images()[:num_images], return_tensors="pt")["pixel_values"]
    ids = vl.gemma3_prompt(num_images, [[2, 5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]])
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == vl.IMAGE_TOKEN).long()
    with torch.inference_mode():
        expected = hf(input_ids=input_ids, pixel_values=pixel_values, token_type_ids=token_type_ids).logits[0].float()
        causal = hf(input_ids=input_ids, pixel_values=pixel_values).logits[0].float()
        embeddings = ours.model.embed_multimodal(pixel_values=list(pixel_values.split(1)))
        token_ids = torch.tensor(ids)
        inputs_embeds = ours.model.embed_input_ids(token_ids, embeddings, is_multimodal=token_ids == vl.IMAGE_TOKEN)
    logits = ours.prefill(ids, torch.arange(len(ids)), inputs_embeds)
    # The two-way image attention matters here (else this test could not tell it from causal attention).
    assert (expected - causal).abs().max() > 100 * ATOL
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_mrope_positions_take_stray_image_tokens_as_text_and_refuse_images_that_do_not_fit():
    # 3 text tokens, an image of 2x2 merged tokens at 3, 2 text tokens: the text resumes at 3 + 2.
    positions, delta = mrope_positions(9, [(3, [1, 4, 4])], spatial_merge_size=2)
    assert positions.tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6], [0, 1, 2, 3, 3, 4, 4, 5, 6], [0, 1, 2, 3, 4, 3, 4, 5, 6]]
    assert delta == 7 - 9
    text_only, zero = mrope_positions(4, [], spatial_merge_size=2)
    assert text_only.tolist() == [[0, 1, 2, 3]] * 3 and zero == 0
    for images in ([(7, [1, 4, 4])], [(0, [1, 4, 4]), (2, [1, 2, 2])]):  # past the end; overlapping
        with pytest.raises(ValueError, match="placeholder tokens"):
            mrope_positions(9, images, spatial_merge_size=2)


def test_vllms_model_config_view_says_which_models_use_mrope(tmp_path):
    from asyncengine import EngineConfig
    from asyncengine.config.vllm_views import SubConfigView

    for name, config, expected in (("qwen2_vl", vl.qwen2_vl_config(), True), ("gemma3", vl.gemma3_config(), False)):
        config.save_pretrained(tmp_path / name)
        view = SubConfigView(EngineConfig(model=str(tmp_path / name)), "model_config")
        assert view.uses_mrope is expected
