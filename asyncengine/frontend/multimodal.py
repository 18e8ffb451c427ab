"""MultiModalInputs: a prompt's images, processed into the expanded prompt and its MultiModalFeatures.

The frontend's half of issue 38's contract (asyncengine/wire/multimodal.py; docs/multimodal.md):

1. the images are checked and made RGB PIL images (media.py), at most `limit_mm_per_prompt` of them;
2. each is hashed (its `identifier`: pixels, mode, size and the processing options) and processed alone by
   the model's processor (MULTIMODAL_REGISTRY, default transformers' AutoProcessor): the text its placeholder
   becomes and its tensors. Processed items are kept in a bounded LRU cache by identifier
   (`mm_processor_cache_gb`), so a repeated image is not processed again;
3. the prompt's placeholders (one per image, in order) are replaced by the items' texts and the whole text
   is tokenized once, as the HF processor itself does, so the token ids are the processor's own; each item's
   span is found through the tokenizer's character offsets: `position` runs from its first to its last
   embedding token, `is_embed` marks those positions where text tokens (Idefics3's row markers) sit between.

A prompt given as token ids has its placeholder token replaced by each item's tokens (tokenized alone).
Everything here is CPU work: AsyncEngine runs it in its tokenizer pool, never on the event loop.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncengine.config.multimodal import DEFAULT_LIMIT_PER_PROMPT, parse_limit_per_prompt
from asyncengine.errors import ConfigError, RequestError
from asyncengine.frontend.media import MediaLimits, image_from_object, image_identifier
from asyncengine.interfaces.models import ModelRegistry
from asyncengine.interfaces.multimodal_registry import (
    DEFAULT_FACTORIES,
    IMAGE,
    MULTIMODAL_REGISTRY,
    BaseMultiModalProcessor,
    ProcessingContext,
    items_per_prompt,
    supports_multimodal,
)
from asyncengine.interfaces.registry import describe, reads
from asyncengine.wire.multimodal import MultiModalFeature, PlaceholderRange, TensorData
from asyncengine.wire.tensors import tensor_to_wire

@dataclass(frozen=True)
class CachedItem:
    replacement: str
    data: dict[str, TensorData]
    nbytes: int


class ProcessedItemCache:
    """Identifier -> processed item, least recently used first out once `capacity` bytes are held; 0: off.
    Shared by the tokenizer pool's threads, hence the lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self.hits = self.misses = 0
        self._items: OrderedDict[str, CachedItem] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> CachedItem | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, key: str, item: CachedItem) -> None:
        if item.nbytes > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._items[key] = item
            self.nbytes += item.nbytes
            while self.nbytes > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._items)


class MultiModalInputs:
    """The frontend's processing of one model's multimodal prompts (see the module's docstring)."""

    def __init__(self, processor: BaseMultiModalProcessor, tokenizer: Any, limits: MediaLimits,
                 limit_per_prompt: Mapping[str, int], options: Mapping[str, Any] | None = None,
                 cache_bytes: int = 0, chat_placeholder: str | None = None) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.limits = limits
        self.limit_per_prompt = dict(limit_per_prompt)
        self.options = dict(options or {})
        self.cache = ProcessedItemCache(cache_bytes)
        self._name = describe(type(processor))
        # What a chat template that prints content as one string gets for an image (vLLM's
        # SupportsMultiModal.get_placeholder_str, e.g. Qwen2-VL's <|vision_start|><|image_pad|><|vision_end|>).
        self.chat_placeholder = chat_placeholder or self.placeholder
        if self.chat_placeholder.count(self.placeholder) != 1:
            raise ConfigError(f"the model's image placeholder for chat {self.chat_placeholder!r} must hold the "
                              f"processor's image token {self.placeholder!r} once", field="model")
        # The tokenizer pool's threads share this tokenizer: transformers' __call__ may reset the Rust
        # tokenizer's truncation and padding state, which fails ("Already borrowed") under a concurrent call.
        self._tokenizer_lock = threading.Lock()

    @property
    def placeholder(self) -> str:
        return self.processor.placeholder(IMAGE)

    @property
    def chat_template(self) -> str | None:
        """The HF processor's chat template (a multimodal checkpoint ships it beside the processor), if any."""
        template = getattr(self.processor.info.get_hf_processor(), "chat_template", None)
        return template if isinstance(template, str) else None

    # -- the items ---------------------------------------------------------------------------------------------

    def images_of(self, multi_modal_data: Any, field: str = "multi_modal_data") -> list[Any]:
        """`multi_modal_data` ({"image": one or a list}) as checked RGB images, within the per-prompt limit."""
        if not isinstance(multi_modal_data, Mapping):
            raise RequestError(f"{field} must be a dict such as {{'image': image_or_list}}, got "
                               f"{type(multi_modal_data).__name__}", field=field)
        unknown = sorted(str(key) for key in multi_modal_data if key != IMAGE)
        if unknown:
            raise RequestError(f"{field}: modality {unknown[0]!r} is not supported (images only)",
                               field=f"{field}.{unknown[0]}")
        items = multi_modal_data.get(IMAGE)
        items = [] if items is None else list(items) if isinstance(items, (list, tuple)) else [items]
        self.check_count(len(items), f"{field}.image")
        return [image_from_object(item, self.limits, f"{field}.image[{index}]") for index, item in enumerate(items)]

    def check_at_startup(self) -> None:
        """One dummy image through the whole path, so that a processor (or an `mm_processor_kwargs` option) that
        cannot work fails start-up, naming it, rather than every request."""
        dummy = self.processor.dummy_inputs
        try:
            images = dummy.get_dummy_mm_data(0, {IMAGE: 1})[IMAGE]
            self.process(dummy.get_dummy_text({IMAGE: 1}), None, images[:1])
        except (RequestError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"the multimodal processor {self._name} cannot process an image with this model's "
                              f"files and mm_processor_kwargs={self.options}: {type(exc).__name__}: {exc}",
                              field="mm_processor_kwargs") from exc

    def check_count(self, count: int, field: str) -> None:
        limit = self.limit_per_prompt.get(IMAGE, DEFAULT_LIMIT_PER_PROMPT)
        if count > limit:
            raise RequestError(f"{field}: {count} images in one prompt, over the limit of {limit} "
                               "(--limit-mm-per-prompt '{\"image\": N}')", field=field)

    def _item(self, image: Any, index: int) -> tuple[str, CachedItem]:
        identifier = image_identifier(image, self.options, self._name)
        cached = self.cache.get(identifier)
        if cached is None:
            try:
                processed = self.processor.process_item(IMAGE, image, self.options)
            except RequestError as exc:
                exc.field = f"multi_modal_data.image[{index}]"
                raise
            data = {name: tensor_to_wire(value) for name, value in processed.data.items()}
            cached = CachedItem(processed.replacement, data, sum(len(t.data) for t in data.values()))
            self.cache.put(identifier, cached)
        return identifier, cached

    # -- the prompt --------------------------------------------------------------------------------------------

    def process(self, text: str | None, token_ids: Sequence[int] | None, images: Sequence[Any], *,
                add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
        """The expanded prompt's token ids and one MultiModalFeature per image, in prompt order."""
        self.check_count(len(images), "multi_modal_data.image")
        items = [self._item(image, index) for index, image in enumerate(images)]
        if text is not None:
            ids, spans = self._expand_text(text, [item.replacement for _, item in items], add_special_tokens)
        else:
            ids, spans = self._expand_ids(list(token_ids or ()), [item.replacement for _, item in items])
        embed_id = self.processor.embed_token_id(IMAGE)
        features = []
        for index, ((identifier, item), (start, end)) in enumerate(zip(items, spans)):
            embeds = [position for position in range(start, end) if ids[position] == embed_id]
            if not embeds:
                raise RuntimeError(f"the multimodal processor {self._name} gave image {index} no embedding token "
                                   f"(id {embed_id}) in its replacement {item.replacement[:80]!r}")
            first, last = embeds[0], embeds[-1]
            is_embed = [ids[position] == embed_id for position in range(first, last + 1)]
            features.append(MultiModalFeature(
                modality=IMAGE, identifier=identifier, data=item.data,
                position=PlaceholderRange(offset=first, length=last - first + 1,
                                          is_embed=None if all(is_embed) else is_embed)))
        return ids, features

    def _placeholder_error(self, found: int, images: int, field: str) -> RequestError:
        return RequestError(
            f"the prompt has {found} image placeholder{'s' if found != 1 else ''} ({self.placeholder!r}) but "
            f"{images} image{'s were' if images != 1 else ' was'} given: put one {self.placeholder} where each "
            "image goes (LLM.chat and the chat API write them from image parts)", field=field)

    def _expand_text(self, text: str, replacements: list[str], add_special_tokens: bool) -> tuple[
            list[int], list[tuple[int, int]]]:
        placeholder = self.placeholder
        pieces = text.split(placeholder)
        if len(pieces) - 1 != len(replacements):
            raise self._placeholder_error(len(pieces) - 1, len(replacements), "prompt")
        expanded, char_spans = pieces[0], []
        for replacement, piece in zip(replacements, pieces[1:]):
            char_spans.append((len(expanded), len(expanded) + len(replacement)))
            expanded += replacement + piece
        with self._tokenizer_lock:
            encoding = self.tokenizer(expanded, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids, offsets = list(encoding["input_ids"]), list(encoding["offset_mapping"])
        spans = []
        for char_start, char_end in char_spans:
            inside = [i for i, (start, end) in enumerate(offsets) if end > start and char_start <= start < char_end]
            spans.append((inside[0], inside[-1] + 1) if inside else (0, 0))
        return ids, spans

    def _expand_ids(self, token_ids: list[int], replacements: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
        placeholder_id = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        found = token_ids.count(placeholder_id)
        if found != len(replacements):
            raise self._placeholder_error(found, len(replacements), "prompt_token_ids")
        ids: list[int] = []
        spans = []
        replacements_left = iter(replacements)
        for token in token_ids:
            if token != placeholder_id:
                ids.append(token)
                continue
            with self._tokenizer_lock:
                replacement = list(self.tokenizer.encode(next(replacements_left), add_special_tokens=False))
            spans.append((len(ids), len(ids) + len(replacement)))
            ids.extend(replacement)
        return ids, spans


@reads("models", "frontend")  # the architecture's class, to read its multimodal registration
@reads("multimodal_processors", "frontend")
def multimodal_inputs(config: Any, model_config: Any, tokenizer: Any) -> MultiModalInputs | None:
    """The frontend's MultiModalInputs for the model, or None for a model that takes no images. A model takes
    images when its config.json has a `vision_config` (every architecture issue 38 serves, and vLLM's dummy
    LLaVA plugin) or its registered class says SupportsMultiModal (a class given by path is imported only in
    the first case: a text model's frontend does not import its model code). The processor is the one
    registered for the class (R14), else transformers' AutoProcessor from the model's folder."""
    hf_config = model_config.load_hf_config()
    architectures = list(getattr(hf_config, "architectures", None) or [])
    has_vision = getattr(hf_config, "vision_config", None) is not None
    model_cls = None
    for architecture in architectures:
        override = (config.model_class_overrides or {}).get(architecture)
        entry = ModelRegistry.get(architecture)
        if override is not None or entry is None:
            continue
        if has_vision or not isinstance(entry.implementation, str):
            model_cls = ModelRegistry.load(architecture)
        break
    if not (has_vision or supports_multimodal(model_cls)):
        return None
    if tokenizer is None:
        raise ConfigError("a multimodal model needs its tokenizer: skip_tokenizer_init cannot be set for it",
                          field="skip_tokenizer_init")
    if model_cls is None:  # a class named by model_class_overrides: the frontend does not import it
        factories = DEFAULT_FACTORIES
    elif getattr(model_cls, "supports_multimodal", False) is True:  # none registered: an error naming the class
        factories = MULTIMODAL_REGISTRY.registration(model_cls, f"the frontend (pid {os.getpid()})")
    else:  # a class that does not say it is multimodal, for a config.json with a vision_config
        factories = MULTIMODAL_REGISTRY.factories_for(model_cls) or DEFAULT_FACTORIES
    ctx = ProcessingContext(str(model_config.model_dir), dict(config.mm_processor_kwargs or {}),
                            bool(config.trust_remote_code))
    processor = factories.build_processor(ctx)
    limits = items_per_prompt(processor.info, parse_limit_per_prompt(config.limit_mm_per_prompt))
    getter = getattr(model_cls, "get_placeholder_str", None)  # vLLM's SupportsMultiModal classmethod
    chat_placeholder = getter(IMAGE, 1) if callable(getter) else None
    inputs = MultiModalInputs(processor, processor.info.get_tokenizer(), MediaLimits.of(config), limits,
                              ctx.mm_processor_kwargs, int(config.mm_processor_cache_gb * 1024**3),
                              chat_placeholder if isinstance(chat_placeholder, str) else None)
    inputs.check_at_startup()
    return inputs


__all__ = ["CachedItem", "MultiModalInputs", "ProcessedItemCache", "multimodal_inputs"]
