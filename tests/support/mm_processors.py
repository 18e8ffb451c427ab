"""Tiny multimodal processors built offline: the default model's tokenizer (SmolLM2, read from its GGUF file)
with the architecture's image tokens added, and transformers' real processor classes with small image sizes.

`save_tiny_processor("idefics3" | "llava", directory)` writes the processor's files (tokenizer, processor and
image-processor configs, a chat template that writes the placeholder for image parts) into `directory`,
where AutoProcessor finds them, beside a model's config.json or alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
LLAVA_TOKENS = ["<image>"]

# ChatML, as SmolLM2's, writing each image part as the placeholder the processor expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOKENIZER: list[Any] = []


def default_tokenizer() -> Any:
    """SmolLM2's tokenizer from the default model's GGUF file (about 6 s, once per process), copied per use."""
    import copy

    from transformers import AutoTokenizer

    from asyncengine.loader.packaged_models import default_model_gguf_path

    if not _TOKENIZER:
        path = default_model_gguf_path()
        _TOKENIZER.append(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    return copy.deepcopy(_TOKENIZER[0])


def build_tiny_processor(kind: str) -> Any:
    """The processor itself (not saved): Idefics3 splits images into 32-pixel tiles of 4 tokens each (a
    global tile besides); LLaVA resizes to 28x28 pixels, 4 tokens of 14-pixel patches."""
    tokenizer = default_tokenizer()
    if kind == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
        images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                           do_image_splitting=True)
        return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                                 chat_template=CHAT_TEMPLATE)
    if kind == "llava":
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        tokenizer.add_special_tokens({"additional_special_tokens": LLAVA_TOKENS})
        images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=CHAT_TEMPLATE)
    raise ValueError(f"no tiny processor {kind!r}: idefics3 or llava")


def save_tiny_processor(kind: str, directory: Path) -> Any:
    processor = build_tiny_processor(kind)
    processor.save_pretrained(str(directory))
    return processor
