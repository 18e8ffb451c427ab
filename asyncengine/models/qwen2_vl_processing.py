"""The input processing of Qwen2-VL and Qwen2.5-VL (MULTIMODAL_REGISTRY, vLLM's shape), images only.

transformers' Qwen2VLProcessor also builds a video processor, which needs torchvision (not a dependency
here), so AutoProcessor cannot load it without: this processor reads the image processor
(preprocessor_config.json: Qwen2VLImageProcessor, pillow-based) and the tokenizer from the model's folder
itself, and expands an image's `<|image_pad|>` into one token per merged patch (the grid's t * h * w over
merge_size^2), as the HF processor does. The chat template writes `<|vision_start|><|image_pad|><|vision_end|>`
for an image part; the tokens around the pad are text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from asyncengine.errors import ModelLoadError, RequestError
from asyncengine.interfaces.multimodal_registry import (
    IMAGE,
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ProcessedItem,
)

IMAGE_PAD = "<|image_pad|>"


class ImagesOnlyProcessor:
    """The names of transformers' processor the frontend reads: `image_processor`, `tokenizer`, `image_token`,
    `image_token_id`, `chat_template`."""

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = IMAGE_PAD
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
        self.chat_template = getattr(tokenizer, "chat_template", None)


class Qwen2VLProcessingInfo(BaseProcessingInfo):
    def get_hf_processor(self) -> Any:
        with self._lock:
            if self._hf_processor is None:
                from transformers import AutoImageProcessor, AutoTokenizer

                folder, remote = self.ctx.model_dir, self.ctx.trust_remote_code
                try:
                    self._hf_processor = ImagesOnlyProcessor(
                        AutoImageProcessor.from_pretrained(folder, local_files_only=True, trust_remote_code=remote),
                        AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=remote))
                except (OSError, ValueError, KeyError) as exc:
                    raise ModelLoadError(f"could not load Qwen2-VL's image processor and tokenizer from {folder}: "
                                         f"{exc}; the folder needs preprocessor_config.json beside the tokenizer's "
                                         "files") from exc
            return self._hf_processor


class Qwen2VLDummyInputsBuilder(BaseDummyInputsBuilder):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return f"<|vision_start|>{IMAGE_PAD}<|vision_end|>" * mm_counts.get(IMAGE, 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int],
                          mm_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Square images of the most pixels the image processor keeps (`max_pixels`)."""
        from PIL import Image

        images = self.info.get_hf_processor().image_processor
        # transformers 5 keeps the bound in size.longest_edge (in pixels), older versions in max_pixels
        size = getattr(images, "size", None)
        longest = size.get("longest_edge") if isinstance(size, Mapping) else getattr(size, "longest_edge", None)
        side = math.isqrt(int(getattr(images, "max_pixels", None) or longest or 448 * 448))
        return {IMAGE: [Image.new("RGB", (side, side)) for _ in range(mm_counts.get(IMAGE, 0))]}


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor):
    def process_item(self, modality: str, item: Any, options: Mapping[str, Any]) -> ProcessedItem:
        if modality != IMAGE:
            raise RequestError(f"modality {modality!r} is not supported: images only", field="multi_modal_data")
        hf = self.info.get_hf_processor()
        try:
            outputs = hf.image_processor(images=[item], return_tensors="pt", **dict(options))
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise RequestError(f"the model's image processor ({type(hf.image_processor).__name__}) refused the "
                               f"image: {exc}", field="multi_modal_data.image") from exc
        grid = outputs["image_grid_thw"]
        merge = int(getattr(hf.image_processor, "merge_size", 2))
        tokens = int(grid.prod()) // (merge * merge)
        return ProcessedItem(replacement=IMAGE_PAD * tokens,
                             data={"pixel_values": outputs["pixel_values"], "image_grid_thw": grid})
