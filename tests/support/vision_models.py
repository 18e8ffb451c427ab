"""Tiny random vision-language checkpoints (Idefics3, LLaVA) with their real transformers processors, and the
prepared multimodal prompts the engine-side tests feed the engine (the frontend's processing path is issue 38's
other half: here the HF processor builds each item's MultiModalFeature as the contract says).

The tokenizer is the default model's (SmolLM2) with the architecture's image tokens added; the language model is
a 2-layer Llama, the vision towers 2 layers, `initializer_range` 0.2 so greedy decoding is decided by the weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncengine.wire.multimodal import MultiModalFeature, PlaceholderRange
from asyncengine.wire.tensors import tensor_to_wire

TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, rms_norm_eps=1e-6, max_position_embeddings=1024,
            bos_token_id=1, eos_token_id=2)


@dataclass
class TinyVLM:
    name: str
    path: Path
    hf_model: Any
    processor: Any
    image_token_id: int


def images(seed: int = 0) -> list[Any]:
    """Two images of different sizes (and aspect ratios)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (100, 70, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 255, (40, 90, 3), dtype=np.uint8))]


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))


def build_idefics3(directory: Path, tokenizer_dir: Path, *, seed: int = 0, arch: str = "Idefics3") -> TinyVLM:
    """Idefics3, or with `arch="SmolVLM"` transformers' SmolVLM classes (the same layout; fed by the Idefics3
    processor, whose prompt layout SmolVLM's model reads the same way: its own processor needs torchvision)."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    image_processor = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 128},
                                                             max_image_size={"longest_edge": 64})
    processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    config = getattr(transformers, f"{arch}Config")(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=16, initializer_range=0.2),
        text_config=dict(TEXT, vocab_size=len(tokenizer)), scale_factor=2, image_token_id=image_token_id,
        initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config).eval()
    _randomize_norms(model, seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return TinyVLM(arch.lower(), directory, model, processor, image_token_id)


def build_llava(directory: Path, tokenizer_dir: Path, *, seed: int = 0) -> TinyVLM:
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                         crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                           projection_dim=32, initializer_range=0.2),
        text_config=dict(TEXT, vocab_size=len(tokenizer)), image_token_index=image_token_id,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize_norms(model, seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return TinyVLM("llava", directory, model, processor, image_token_id)


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    features: list[MultiModalFeature]
    hf_inputs: dict[str, torch.Tensor]  # the processor's outputs for the whole prompt, for transformers


def prepare(vlm: TinyVLM, text: str, prompt_images: list[Any]) -> PreparedPrompt:
    """The prompt's tokens (placeholders expanded by the real processor) and one MultiModalFeature per image:
    its span from its first image token to its last, `is_embed` where text tokens sit inside, its own
    processor outputs (each image processed alone), its identifier the hash of its pixels."""
    whole = vlm.processor(text=[text], images=[prompt_images], return_tensors="pt")
    token_ids = whole["input_ids"][0].tolist()
    spans = _image_spans(vlm, token_ids, prompt_images)
    features = []
    for image, (start, end) in zip(prompt_images, spans):
        alone = vlm.processor.image_processor(images=[image], return_tensors="pt")
        data = {name: tensor_to_wire(value) for name, value in alone.items() if isinstance(value, torch.Tensor)}
        is_embed = [token == vlm.image_token_id for token in token_ids[start:end]]
        features.append(MultiModalFeature(
            modality="image", identifier=hashlib.sha256(image.tobytes()).hexdigest(),
            position=PlaceholderRange(offset=start, length=end - start, is_embed=None if all(is_embed) else is_embed),
            data=data))
    return PreparedPrompt(token_ids, features, dict(whole))


def _image_spans(vlm: TinyVLM, token_ids: list[int], prompt_images: list[Any]) -> list[tuple[int, int]]:
    """[first, last + 1) of each image's tokens in the prompt: the run the processor makes for the image alone
    (Idefics3 frames its tiles with text tokens, which the run keeps), found in order."""
    image_token = vlm.image_token_id
    spans: list[tuple[int, int]] = []
    cursor = 0
    for image in prompt_images:
        alone = vlm.processor(text=["<image>"], images=[[image]])["input_ids"][0]
        alone = [int(token) for token in alone]
        first = alone.index(image_token)
        last = len(alone) - 1 - alone[::-1].index(image_token)
        run = alone[first:last + 1]
        start = next((i for i in range(cursor, len(token_ids) - len(run) + 1) if token_ids[i:i + len(run)] == run),
                     None)
        if start is None:
            raise AssertionError(f"image {len(spans)}'s placeholder run is not in the prompt")
        spans.append((start, start + len(run)))
        cursor = start + len(run)
    return spans
