"""The frontend's processing of images into issue 38's contract (frontend/multimodal.py), on tiny Idefics3
(SmolVLM) and LLaVA processors built offline (tests/support/mm_processors.py: SmolLM2's tokenizer with the image
tokens added, transformers' real processor classes): the expanded prompt is token for token what the HF
processor gives, each image's span and tensors are its own, identifiers and the cache behave, and bad
prompts are RequestErrors naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from asyncengine import EngineConfig, RequestError
from asyncengine.frontend.media import MediaLimits
from asyncengine.frontend.multimodal import MultiModalInputs
from asyncengine.frontend.processor import InputProcessor
from asyncengine.interfaces.multimodal_registry import DEFAULT_FACTORIES, ProcessingContext
from asyncengine.wire.multimodal import MultiModalFeature
from support.mm_processors import save_tiny_processor


def noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def as_tensor(data) -> torch.Tensor:
    """A TensorData back as torch (what the worker does with it)."""
    return torch.frombuffer(bytearray(data.data), dtype=getattr(torch, data.dtype)).reshape(data.shape)


@pytest.fixture(scope="module", params=["idefics3", "llava"])
def tiny(request, tmp_path_factory):
    directory: Path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_processor(request.param, directory)
    processor = DEFAULT_FACTORIES.build_processor(ProcessingContext(str(directory)))
    inputs = MultiModalInputs(processor, processor.info.get_tokenizer(), MediaLimits(), {"image": 3}, {}, 1 << 24)
    return request.param, hf, inputs


IMAGES = [noise(70, 50, 1), noise(24, 64, 2)]  # different sizes and shapes: Idefics3 tiles them differently
TEXT = "Look: <image> and then\n<image>, which is bigger?"


def test_the_expanded_prompt_is_the_hf_processors_and_each_span_is_its_images(tiny):
    kind, hf, inputs = tiny
    token_ids, features = inputs.process(TEXT, None, IMAGES)
    reference = hf(text=[TEXT], images=IMAGES, return_tensors="pt")
    assert token_ids == reference["input_ids"][0].tolist()
    embed_id = hf.image_token_id
    assert len(features) == 2 and all(isinstance(f, MultiModalFeature) and f.modality == "image" for f in features)
    assert features[0].position.offset + features[0].position.length <= features[1].position.offset
    for feature, image in zip(features, IMAGES):
        start, length = feature.position.offset, feature.position.length
        span = token_ids[start:start + length]
        is_embed = feature.position.is_embed or [True] * length
        assert span[0] == span[-1] == embed_id  # from its first to its last image token
        assert [token == embed_id for token in span] == is_embed
        alone = hf(text=[hf.image_token], images=[image], return_tensors="pt")
        assert sum(is_embed) == int((alone["input_ids"][0] == embed_id).sum())
        assert sorted(feature.data) == sorted(k for k in ("pixel_values", "pixel_attention_mask") if k in alone)
        for name, data in feature.data.items():
            assert torch.equal(as_tensor(data), alone[name]), name
    assert sum(sum(f.position.is_embed or [True] * f.position.length) for f in features) == \
        int((reference["input_ids"][0] == embed_id).sum())
    if kind == "idefics3":  # row and column markers sit inside the span: is_embed says which positions embed
        assert all(f.position.is_embed is not None and not all(f.position.is_embed) for f in features)
        assert features[0].position.length != features[1].position.length  # 2x2 tiles against 2x1
    else:
        assert all(f.position.is_embed is None and f.position.length == 4 for f in features)


def test_token_id_prompts_expand_the_same(tiny):
    _, hf, inputs = tiny
    token_ids, features = inputs.process(TEXT, None, IMAGES)
    from_ids, features_from_ids = inputs.process(None, hf.tokenizer.encode(TEXT), IMAGES)
    assert (from_ids, features_from_ids) == (token_ids, features)


def test_identifiers_and_the_processed_item_cache(tiny):
    _, _, inputs = tiny
    first = inputs.process("<image>", None, [noise(40, 40, 7)])[1][0]
    hits = inputs.cache.hits
    again = inputs.process("again <image>", None, [noise(40, 40, 7)])[1][0]  # equal pixels, another object
    assert again.identifier == first.identifier and inputs.cache.hits == hits + 1 and again.data == first.data
    other = inputs.process("<image>", None, [noise(40, 40, 8)])[1][0]
    assert other.identifier != first.identifier
    assert len(first.identifier) == 64 and int(first.identifier, 16) >= 0


def test_bad_prompts_are_request_errors_naming_the_field(tiny):
    _, _, inputs = tiny
    with pytest.raises(RequestError, match="1 image placeholder.*2 images were given") as info:
        inputs.process("only <image>", None, IMAGES)
    assert info.value.field == "prompt"
    with pytest.raises(RequestError, match="placeholder") as info:
        inputs.process(None, [1, 2, 3], IMAGES)
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(RequestError, match="over the limit of 3") as info:
        inputs.images_of({"image": [IMAGES[0]] * 4})
    assert info.value.field == "multi_modal_data.image"
    with pytest.raises(RequestError, match="images only") as info:
        inputs.images_of({"video": [IMAGES[0]]})
    assert info.value.field == "multi_modal_data.video"
    with pytest.raises(RequestError, match="not an image") as info:
        inputs.images_of({"image": [IMAGES[0], b"\x89PNG\r\n\x1a\n" + bytes(20)]})
    assert info.value.field == "multi_modal_data.image[1]"


def test_the_input_processor_sends_the_features_with_every_completion(tiny):
    from asyncengine.config.model import ModelConfig

    _, hf, inputs = tiny
    model = ModelConfig(model_dir="x", tokenizer_dir=None, served_model_name="m", architectures=["X"], hf_config={},
                        dtype="float32", max_model_len=4096, vocab_size=len(hf.tokenizer), eos_token_ids=[2],
                        generation_defaults={})
    processor = InputProcessor(EngineConfig(), model, hf.tokenizer, multimodal=inputs)
    from asyncengine import SamplingParams

    out = processor.process("r", {"prompt": TEXT, "multi_modal_data": {"image": IMAGES}}, SamplingParams(n=2))
    expected_ids, expected_features = inputs.process(TEXT, None, IMAGES)
    assert out.prompt == TEXT and out.prompt_token_ids == expected_ids
    assert [child.mm_features for child in out.children] == [expected_features] * 2
    with pytest.raises(RequestError, match="truncate_prompt_tokens") as info:
        processor.process("r", {"prompt": TEXT, "multi_modal_data": {"image": IMAGES}},
                          SamplingParams(truncate_prompt_tokens=5))
    text_only = InputProcessor(EngineConfig(), model, hf.tokenizer)
    with pytest.raises(RequestError, match="not a multimodal model") as info:
        text_only.process("r", {"prompt": TEXT, "multi_modal_data": {"image": IMAGES}}, None)
    assert info.value.field == "multi_modal_data"


def test_processor_options_and_dummy_inputs(tiny, tmp_path):
    kind, hf, inputs = tiny
    processor = inputs.processor
    dummy = processor.dummy_inputs
    text = dummy.get_dummy_text({"image": 2})
    data = dummy.get_dummy_mm_data(256, {"image": 2})
    token_ids, features = inputs.process(text, None, data["image"])  # the profiling inputs process like any
    assert text == hf.image_token * 2 and len(features) == 2
    if kind == "idefics3":  # an option of the processor's changes the expansion and the identifier
        save_tiny_processor(kind, tmp_path)
        unsplit = DEFAULT_FACTORIES.build_processor(ProcessingContext(str(tmp_path), {"do_image_splitting": False}))
        options = {"do_image_splitting": False}
        plain = MultiModalInputs(unsplit, unsplit.info.get_tokenizer(), MediaLimits(), {"image": 3}, options, 0)
        feature = plain.process("<image>", None, [IMAGES[0]])[1][0]
        split = inputs.process("<image>", None, [IMAGES[0]])[1][0]
        assert sum(feature.position.is_embed or [True] * feature.position.length) == 4  # the global tile alone
        assert feature.identifier != split.identifier and len(plain.cache) == 0  # a cache of 0 bytes keeps nothing


def test_the_cache_evicts_the_least_recently_used_by_bytes():
    from asyncengine.frontend.multimodal import CachedItem, ProcessedItemCache

    cache = ProcessedItemCache(capacity=100)
    for key in "abc":
        cache.put(key, CachedItem("r", {}, 40))
    assert cache.get("a") is None and cache.nbytes == 80  # a went out when c came in
    assert cache.get("b") is not None  # b is now the most recent
    cache.put("d", CachedItem("r", {}, 40))
    assert cache.get("c") is None and cache.get("b") is not None and cache.get("d") is not None
    cache.put("huge", CachedItem("r", {}, 101))  # larger than the whole cache: not kept
    assert cache.get("huge") is None and len(cache) == 2


def test_a_processor_that_cannot_work_fails_start_up_naming_it(tiny):
    from asyncengine.errors import ConfigError
    from asyncengine.interfaces.multimodal_registry import BaseMultiModalProcessor

    _, _, inputs = tiny

    class Broken(BaseMultiModalProcessor):
        def process_item(self, modality, item, options):
            raise ValueError("size must have longest_edge")

    broken = Broken(inputs.processor.info)
    checked = MultiModalInputs(broken, inputs.tokenizer, MediaLimits(), {"image": 1}, {"size": 3}, 0)
    with pytest.raises(ConfigError, match="Broken cannot process an image.*longest_edge") as info:
        checked.check_at_startup()
    assert info.value.field == "mm_processor_kwargs"
    inputs.check_at_startup()  # a working one passes


def test_a_models_own_chat_placeholder_holds_the_image_token_once(tiny):
    from asyncengine.errors import ConfigError

    _, hf, inputs = tiny
    wrapped = MultiModalInputs(inputs.processor, inputs.tokenizer, MediaLimits(), {"image": 1}, {}, 0,
                               chat_placeholder=f"<vision>{hf.image_token}</vision>")
    assert wrapped.chat_placeholder == f"<vision>{hf.image_token}</vision>" and inputs.chat_placeholder == hf.image_token
    token_ids, features = wrapped.process(f"see <vision>{hf.image_token}</vision>", None, [IMAGES[0]])
    assert len(features) == 1
    with pytest.raises(ConfigError, match="once"):
        MultiModalInputs(inputs.processor, inputs.tokenizer, MediaLimits(), {"image": 1}, {}, 0,
                         chat_placeholder="<vision></vision>")
