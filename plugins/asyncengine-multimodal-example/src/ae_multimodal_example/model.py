"""ExampleLlavaForConditionalGeneration: asyncengine's LLaVA under an architecture name of its own, with its own
input processing registered on the class (vLLM's shape):

    @MULTIMODAL_REGISTRY.register_processor(ExampleMultiModalProcessor, info=ExampleProcessingInfo,
                                            dummy_inputs=ExampleDummyInputsBuilder)

It computes what the built-in `LlavaForConditionalGeneration` computes (same layers, weight names, processing), so
a checkpoint whose config.json says `"architectures": ["ExampleLlavaForConditionalGeneration"]` gives the built-in
model's greedy outputs. What it changes:
- `ExampleProcessingInfo.get_supported_mm_limits()`: at most 2 images per prompt (the frontend refuses a third;
  the worker profiles with 2);
- `ExampleDummyInputsBuilder`: the profiling images are mid-grey rather than black, at the image processor's
  crop size (what every image is resized and cropped to);
- with AE_PLUGIN_RECORD naming a file, the processor's construction, each dummy-inputs build and the model's
  construction append one JSON line there ({"plugin", "event", "pid", "role", ...}), the role as
  `current_process_role()` says: "frontend", "worker rank 0", ...
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from asyncengine.plugins_api import (
    MULTIMODAL_REGISTRY,
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
    current_process_role,
)

__all__ = ["ExampleDummyInputsBuilder", "ExampleLlavaForConditionalGeneration", "ExampleMultiModalProcessor",
           "ExampleProcessingInfo", "MAX_IMAGES", "RECORD_ENV"]

RECORD_ENV = "AE_PLUGIN_RECORD"
MAX_IMAGES = 2


def record(event: str, **fields: Any) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = {"plugin": "ae_multimodal_example", "event": event, "pid": os.getpid(), "role": current_process_role(),
            **fields}
    with open(path, "a", encoding="utf-8") as file:  # one write of one line: processes do not interleave
        file.write(json.dumps(line) + "\n")


class ExampleProcessingInfo(LlavaProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": MAX_IMAGES}


class ExampleDummyInputsBuilder(LlavaDummyInputsBuilder):
    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int],
                          mm_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from PIL import Image

        crop = self.info.get_hf_processor().image_processor.crop_size  # {"height": h, "width": w}
        count = mm_counts.get("image", 0)
        record("dummy inputs", images=count, seq_len=seq_len)
        return {"image": [Image.new("RGB", (crop["width"], crop["height"]), (128, 128, 128)) for _ in range(count)]}


class ExampleMultiModalProcessor(LlavaMultiModalProcessor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        record("processor built", cls=type(self).__name__)


@MULTIMODAL_REGISTRY.register_processor(ExampleMultiModalProcessor, info=ExampleProcessingInfo,
                                        dummy_inputs=ExampleDummyInputsBuilder)
class ExampleLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """Built by the worker with the built-in model's constructor arguments (config, dtype, max_position)."""

    def __init__(self, config: Any, *, dtype: Any, max_position: int) -> None:
        super().__init__(config, dtype=dtype, max_position=max_position)
        record("model built", cls=f"{type(self).__module__}:{type(self).__qualname__}")
