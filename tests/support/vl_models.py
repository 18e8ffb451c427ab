"""Tiny random vision-language models of the Qwen2-VL family and Gemma 3 (initializer_range 0.2), their real
image processors, and one prefill of our module on the paged attention path, for the model-level tests of
tests/models/test_qwen_vl_gemma3_mm.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VOCAB = 320
IMAGE_TOKEN, VISION_START, VISION_END = 300, 301, 302
BOI, EOI = 303, 304  # Gemma 3's begin/end of image


@dataclass(frozen=True)
class Tokens:
    """The vocabulary's size and the image tokens' ids (the engine tests': the default model's tokenizer with
    the architecture's tokens added)."""

    vocab: int = VOCAB
    image: int = IMAGE_TOKEN
    start: int = VISION_START  # Qwen's <|vision_start|>, Gemma 3's <start_of_image>
    end: int = VISION_END


def _text(extra: dict[str, Any], vocab: int) -> dict[str, Any]:
    return {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=1024, initializer_range=0.2,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0), **extra}


def qwen2_vl_config(tokens: Tokens = Tokens()) -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=_text({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                               "rope_theta": 10000.0}}, tokens.vocab),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2),
        image_token_id=tokens.image, vision_start_token_id=tokens.start, vision_end_token_id=tokens.end,
        initializer_range=0.2)


def qwen2_5_vl_config(tokens: Tokens = Tokens()) -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=_text({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                               "rope_theta": 10000.0}}, tokens.vocab),
        # Windows of 56 pixels (2x2 merged tokens): the 4x6-token image spans several, block 1 attends whole.
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], hidden_act="silu", initializer_range=0.2),
        image_token_id=tokens.image, vision_start_token_id=tokens.start, vision_end_token_id=tokens.end,
        initializer_range=0.2)


def gemma3_config(tokens: Tokens = Tokens(start=BOI, end=EOI)) -> Any:
    from transformers import Gemma3Config

    # A sliding window of 8 on layer 0: the prompts reach past it, and an image's rows see later ones within it.
    return Gemma3Config(
        # Three layers: the two-way image attention of layer 1 reaches the text after the image through layer 2.
        text_config=_text({"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3, "query_pre_attn_scalar": 16,
                           "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, tokens.vocab),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14, vision_use_head=False, initializer_range=0.2),
        mm_tokens_per_image=4, image_token_id=tokens.image, boi_token_id=tokens.start, eoi_token_id=tokens.end,
        # Untied: with the head tied to the sqrt(hidden)-scaled embeddings a 2-layer model repeats its last token.
        tie_word_embeddings=False, initializer_range=0.2)


def gemma3_image_processor() -> Any:
    from transformers import Gemma3ImageProcessor

    return Gemma3ImageProcessor(size={"height": 56, "width": 56})


def gemma3_prompt(num_images: int, text: list[list[int]], tokens: Tokens = Tokens(start=BOI, end=EOI)) -> list[int]:
    ids = list(text[0])
    for after in text[1:num_images + 1]:
        ids += [tokens.start] + [tokens.image] * 4 + [tokens.end] + list(after)
    return ids


def qwen_image_processor(kind: str) -> Any:
    from transformers import Qwen2VLImageProcessor

    # Small pixel bounds: the test images keep their sizes (multiples of 28) and stay a few dozen patches.
    return Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=200 * 28 * 28)


def two_images() -> list[Any]:
    """Two images of different sizes (and aspect ratios)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (112, 56, 3), dtype=np.uint8))]


def qwen_prompt(grids: list[list[int]], text: list[list[int]], tokens: Tokens = Tokens()) -> list[int]:
    """text[0], image 0's placeholders, text[1], ...: each image `vision_start, image_pad * n, vision_end`."""
    ids = list(text[0])
    for grid, after in zip(grids, text[1:]):
        ids += [tokens.start] + [tokens.image] * (grid[0] * grid[1] * grid[2] // 4) + [tokens.end] + list(after)
    return ids


@dataclass
class Bound:
    """Our model with a KV cache and the torch backend bound, for direct prefills."""

    model: Any
    block_size: int = 16

    def prefill(self, token_ids: list[int], positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        from asyncengine.models.layers.attention import AttentionMetadata

        n = len(token_ids)
        blocks = -(-n // self.block_size)
        metadata = AttentionMetadata(torch.arange(n), None, [n], [n], torch.arange(blocks).unsqueeze(0),
                                     block_size=self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(token_ids), positions, metadata, inputs_embeds=inputs_embeds)
            return self.model.compute_logits(hidden).float()


def bind(model: Any, num_blocks: int = 32, block_size: int = 16) -> Bound:
    from asyncengine.attention.torch_paged import TorchPagedBackend
    from asyncengine.interfaces.attention import build_backend
    from asyncengine.models.layers.attention import PagedAttention

    for layer in model.modules():
        if isinstance(layer, PagedAttention):
            shape = (layer.num_kv_heads, num_blocks, block_size, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape), torch.zeros(shape))
            layer.backend = build_backend(TorchPagedBackend, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                          layer.scale, sliding_window=layer.sliding_window,
                                          logits_soft_cap=layer.logits_soft_cap)
    return Bound(model, block_size)


def ours_from(hf_model: Any, cls: type, max_position: int = 1024) -> Bound:
    """Our `cls` built from `hf_model`'s config with its weights (float32)."""
    model = cls(hf_model.config, dtype=torch.float32, max_position=max_position)
    model.load_weights((name, tensor.detach().clone()) for name, tensor in hf_model.state_dict().items())
    return bind(model.eval())


# -- the engine: tiny checkpoints on disk, prompts as the frontend sends them ------------------------------------


QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


@dataclass
class SavedVLM:
    name: str
    path: Any
    hf_model: Any
    image_processor: Any
    tokens: Tokens


def save(name: str, directory: Any, tokenizer_dir: Any, seed: int = 0) -> SavedVLM:
    """One of "qwen2_vl", "qwen2_5_vl", "gemma3", built at random and saved (weights, config.json, and the
    default model's tokenizer with the architecture's image tokens added)."""
    import transformers

    added = GEMMA3_TOKENS if name == "gemma3" else QWEN_TOKENS
    # Gemma 3's processor reads its image tokens by name from the tokenizer.
    named = dict(zip(("boi_token", "image_token", "eoi_token"), added)) if name == "gemma3" else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=named)
    tokenizer.add_tokens(added, special_tokens=True)
    start, image, end = tokenizer.convert_tokens_to_ids(added)
    tokens = Tokens(len(tokenizer), image, start, end)
    tokenizer.save_pretrained(str(directory))
    processor = gemma3_image_processor() if name == "gemma3" else qwen_image_processor(name)
    if name == "gemma3":  # transformers' Gemma3Processor (its tokenizer names the image tokens)
        transformers.Gemma3Processor(image_processor=processor, tokenizer=tokenizer,
                                     image_seq_length=4).save_pretrained(str(directory))
    else:  # the image processor alone (asyncengine/models/qwen2_vl_processing.py)
        processor.save_pretrained(str(directory))
    config = {"qwen2_vl": qwen2_vl_config, "qwen2_5_vl": qwen2_5_vl_config, "gemma3": gemma3_config}[name](tokens)
    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "gemma3": transformers.Gemma3ForConditionalGeneration}[name]
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(directory)
    return SavedVLM(name, directory, model, processor, tokens)


@dataclass
class Prepared:
    token_ids: list[int]
    features: list[Any]  # MultiModalFeature, one per image
    hf_inputs: dict[str, torch.Tensor]  # what transformers' generate takes for the same prompt


def prepare(vlm: SavedVLM, images: list[Any], text: list[list[int]]) -> Prepared:
    """The prompt's token ids with each image's placeholder tokens, and each image's MultiModalFeature (its own
    processor outputs, its span over its placeholder tokens, the hash of its pixels): the wire contract."""
    import hashlib

    from asyncengine.wire.multimodal import MultiModalFeature, PlaceholderRange
    from asyncengine.wire.tensors import tensor_to_wire

    alone = [vlm.image_processor(images=[image], return_tensors="pt") for image in images]
    image_token = vlm.tokens.image
    if vlm.name == "gemma3":
        token_ids = gemma3_prompt(len(images), text, vlm.tokens)
    else:
        token_ids = qwen_prompt([item["image_grid_thw"][0].tolist() for item in alone], text, vlm.tokens)
    runs, start = [], None
    for index, token in enumerate(token_ids + [-1]):
        if token == image_token and start is None:
            start = index
        elif token != image_token and start is not None:
            runs.append((start, index - start))
            start = None
    features = [MultiModalFeature(modality="image", identifier=hashlib.sha256(image.tobytes()).hexdigest(),
                                  position=PlaceholderRange(offset=offset, length=length),
                                  data={name: tensor_to_wire(value) for name, value in item.items()
                                        if isinstance(value, torch.Tensor)})
                for image, item, (offset, length) in zip(images, alone, runs)]
    return Prepared(token_ids, features, transformers_inputs(vlm, token_ids, alone))


def transformers_inputs(vlm: SavedVLM, token_ids: list[int], processed: list[Any]) -> dict[str, torch.Tensor]:
    """What transformers' generate takes for `token_ids` and its images' processor outputs (`processed`)."""
    input_ids = torch.tensor([token_ids])
    is_image = input_ids == vlm.tokens.image
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids,
                                       "pixel_values": torch.cat([item["pixel_values"] for item in processed])}
    if vlm.name == "gemma3":
        inputs["token_type_ids"] = is_image.long()
    else:
        inputs.update(image_grid_thw=torch.cat([item["image_grid_thw"] for item in processed]),
                      mm_token_type_ids=is_image.int())
    return inputs


def hf_greedy(vlm: SavedVLM, prompt: Prepared, max_tokens: int,
              without: tuple[str, ...] = ()) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability (float32), its inputs less `without`."""
    inputs = {name: value for name, value in prompt.hf_inputs.items() if name not in without}
    with torch.inference_mode():
        out = vlm.hf_model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt.token_ids):].tolist()
    # The raw logits: the scores have EOS masked by min_new_tokens, which the engine's ignore_eos does not do.
    logprobs = [float(logits[0].float().log_softmax(-1)[token]) for logits, token in zip(out.logits, tokens)]
    return tokens, logprobs
