"""The worker's profile of a multimodal model with its registration's dummy inputs (asyncengine/worker/mm_profile.py),
with stand-in processing classes and model: how many images the vision encoder runs on (vLLM's count), the checks of
what the builder and the model give, and the record. The real path (a tiny LLaVA, a plugin's registration, in a worker
process) is tests/e2e/test_multimodal_plugin.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncengine.errors import StartupError
from asyncengine.interfaces.multimodal_registry import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ProcessedItem,
    ProcessorFactories,
)
from asyncengine.worker.mm_profile import profile_encoder

ROWS = 4  # embedding rows per image: its placeholder becomes "#" x 4, and "#" is the embedding token


class Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(char) for char in text]


class Info(BaseProcessingInfo):
    def get_tokenizer(self):
        return Tokenizer()

    def get_supported_mm_limits(self):
        return {"image": 3}


class Dummy(BaseDummyInputsBuilder):
    def get_dummy_text(self, mm_counts):
        return "<i>" * mm_counts["image"]

    def get_dummy_mm_data(self, seq_len, mm_counts, mm_options=None):
        from PIL import Image

        return {"image": [Image.new("RGB", (4, 4)) for _ in range(mm_counts["image"])]}


class OneImageShort(Dummy):
    def get_dummy_mm_data(self, seq_len, mm_counts, mm_options=None):
        return {"image": super().get_dummy_mm_data(seq_len, mm_counts)["image"][1:]}


class Processor(BaseMultiModalProcessor):
    def placeholder(self, modality="image"):
        return "<i>"

    def embed_token_id(self, modality="image"):
        return ord("#")

    def process_item(self, modality, item, options):
        return ProcessedItem("#" * ROWS, {"pixel_values": torch.ones(1, 3, 2, 2)})


class Model:
    supports_multimodal = True

    def __init__(self, rows=ROWS):
        self.rows = rows
        self.calls: list[int] = []

    def embed_multimodal(self, pixel_values):
        self.calls.append(len(pixel_values))
        return [torch.zeros(self.rows, 8) for _ in pixel_values]


def configs(limit=5, budget=40, max_num_seqs=4):
    model_config = SimpleNamespace(model_dir="/nowhere", max_model_len=64)
    engine_config = SimpleNamespace(mm_processor_kwargs=None, trust_remote_code=False,
                                    limit_mm_per_prompt={"image": limit}, effective_max_num_batched_tokens=budget,
                                    max_num_seqs=max_num_seqs)
    return model_config, engine_config


def profile(model, dummy=Dummy, device="meta", **options):
    return profile_encoder(model, ProcessorFactories(Processor, Info, dummy), "plugin 'p' (p-dist)", *configs(**options),
                           torch.device(device), "worker rank 0")


def test_the_encoder_runs_on_what_one_steps_encoder_budget_admits_and_its_output_is_held():
    model = Model()
    result = profile(model)  # 3 images per prompt (the info caps the option's 5), 4 rows each
    # vLLM's count: min(3 per prompt x 4 sequences, budget 40 // 4 rows) = 10 images, in one call
    assert model.calls == [10] and len(result.embeddings) == 10
    record = result.record
    assert (record.role, record.phase, record.plugin, record.outcome) == ("worker rank 0", "kv cache",
                                                                          "multimodal profile", "ok")
    here = Processor.__module__
    assert record.reason.startswith(
        f"{here}:Processor with dummy inputs {here}:Dummy (registered by plugin 'p' (p-dist)): "
        "3 image(s) per prompt, at most 4 embedding rows per image, the largest prompt 12 tokens; the vision "
        "encoder ran on 10 image(s)"), record.reason
    # an image larger than the budget still runs (alone), as the scheduler lets it; on CPU one prompt's images
    assert profile(Model(), budget=2).embeddings.__len__() == 1
    assert len(profile(Model(), device="cpu").embeddings) == 3


def test_no_image_allowed_skips_the_profile():
    model = Model()
    result = profile(model, limit=0)
    assert model.calls == [] and result.embeddings == [] and result.record.outcome == "skipped"
    assert "limit_mm_per_prompt allows no image" in result.record.reason


def test_a_builder_or_a_model_that_does_not_fit_fails_start_up_naming_it():
    with pytest.raises(StartupError, match=r"OneImageShort.*asked for 3 image\(s\), the dummy inputs "
                                           r"builder gave 2 image\(s\) and a text with 3 placeholder\(s\)"):
        profile(Model(), dummy=OneImageShort)
    with pytest.raises(StartupError, match=r"Model.embed_multimodal made 5 rows for a dummy image of "
                                           r".*Processor .* whose placeholder takes 4: the model and "
                                           r"its processor registration disagree"):
        profile(Model(rows=5))
