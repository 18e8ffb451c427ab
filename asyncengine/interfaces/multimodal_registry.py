"""MULTIMODAL_REGISTRY: which input processor a multimodal model class takes (docs/multimodal.md, reference R14).

vLLM's shape, on the model class:

    @MULTIMODAL_REGISTRY.register_processor(MyProcessor, info=MyProcessingInfo, dummy_inputs=MyDummyInputsBuilder)
    class MyVLM(nn.Module, SupportsMultiModal): ...

Read in the frontend (which processor turns a prompt's images into placeholder tokens and tensors:
frontend/multimodal.py) and in the worker (profiling with dummy inputs). The entry is found through the
class's MRO, as vLLM does, so a subclass of a registered model (vLLM's dummy LLaVA plugin) takes its
parent's processor. An architecture whose class has no entry gets the defaults below: transformers'
AutoProcessor from the model's folder.

The three classes are ours, in vLLM's roles (not its internals): `BaseProcessingInfo` knows the model
(its HF processor, the limits per prompt), `BaseDummyInputsBuilder` makes profiling inputs, and
`BaseMultiModalProcessor` processes one item at a time: the text the item's placeholder becomes in the
prompt and the tensors the vision tower takes. The frontend does the rest once for every processor
(loading, content hashes, the processed-item cache, expanding the prompt, the wire contract).

Nothing here imports transformers, torch or pillow at import time: plugins_api re-exports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncengine.errors import MissingRegistration, ModelLoadError, RequestError
from asyncengine.interfaces.registry import BUILT_IN, Registry, RegistrationError, current_registrant, describe

IMAGE = "image"
M = TypeVar("M", bound=type)


@dataclass(frozen=True)
class ProcessingContext:
    """What a processor is built from: the model's folder (config.json, the processor's files), the
    `mm_processor_kwargs` option (given to the HF processor's every call, part of each item's hash) and
    whether the folder's own Python code may run."""

    model_dir: str
    mm_processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False


@dataclass(frozen=True)
class ProcessedItem:
    """One item, processed: `replacement` is the text its placeholder becomes in the prompt (for LLaVA
    `<image>` repeated; for Idefics3 the tiles' grid with row/column markers), `data` the processor's
    tensors for this item alone (torch tensors by name: pixel_values, pixel_attention_mask, image_grid_thw...)."""

    replacement: str
    data: Mapping[str, Any]


class BaseProcessingInfo:
    """vLLM's ProcessingInfo: what the processor and the dummy inputs need to know of the model."""

    def __init__(self, ctx: ProcessingContext) -> None:
        self.ctx = ctx
        self._hf_processor: Any = None
        self._lock = threading.Lock()

    def get_hf_processor(self) -> Any:
        """transformers' processor from the model's folder (AutoProcessor; local files only), built once."""
        with self._lock:
            if self._hf_processor is None:
                from transformers import AutoProcessor

                try:
                    self._hf_processor = AutoProcessor.from_pretrained(
                        self.ctx.model_dir, local_files_only=True, trust_remote_code=self.ctx.trust_remote_code)
                except (OSError, ValueError, KeyError) as exc:
                    raise ModelLoadError(f"could not load the multimodal processor from {self.ctx.model_dir}: "
                                         f"{exc}; the folder needs the processor's files (processor_config.json, "
                                         "preprocessor_config.json) beside the tokenizer's") from exc
            return self._hf_processor

    def get_tokenizer(self) -> Any:
        return self.get_hf_processor().tokenizer

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        """Modality -> the most items one prompt may carry (None: no limit of the model's own)."""
        return {IMAGE: None}


class BaseDummyInputsBuilder:
    """vLLM's DummyInputsBuilder: the largest inputs a prompt may carry, for profiling in the worker."""

    def __init__(self, info: BaseProcessingInfo) -> None:
        self.info = info

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        placeholder = self.info.get_hf_processor().image_token
        return placeholder * mm_counts.get(IMAGE, 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int],
                          mm_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`mm_counts` images of the size the image processor resizes to (its `size`), blank."""
        from PIL import Image

        size = getattr(self.info.get_hf_processor().image_processor, "size", None) or {}
        side = max((int(value) for value in size.values() if isinstance(value, int)), default=448) \
            if isinstance(size, Mapping) else 448
        return {IMAGE: [Image.new("RGB", (side, side)) for _ in range(mm_counts.get(IMAGE, 0))]}


class BaseMultiModalProcessor:
    """Processes one item at a time (the frontend expands the prompt and caches items by content hash).

    The default works for transformers processors that expand placeholders with `replace_image_token`
    (LLaVA, Idefics3 / SmolVLM, Qwen2-VL and 2.5-VL, Gemma 3 in transformers 5): override `placeholder`,
    `embed_token_id` or `process_item` for one that does not."""

    def __init__(self, info: BaseProcessingInfo, dummy_inputs: BaseDummyInputsBuilder | None = None) -> None:
        self.info = info
        self.dummy_inputs = dummy_inputs or BaseDummyInputsBuilder(info)

    def placeholder(self, modality: str = IMAGE) -> str:
        """The text that stands for one item in a prompt (what the chat template writes for an image part,
        and what a user writes in a text prompt): `<image>` for LLaVA and Idefics3."""
        _check_modality(modality)
        return str(self.info.get_hf_processor().image_token)

    def embed_token_id(self, modality: str = IMAGE) -> int:
        """The token that takes one of the item's embeddings in the expanded prompt. The tokenizer's
        `image_token_id` where it has one (Gemma 3: the soft token, its processor's being the begin-of-image
        marker), else the processor's."""
        _check_modality(modality)
        hf = self.info.get_hf_processor()
        token_id = getattr(hf.tokenizer, "image_token_id", None)
        return int(token_id) if isinstance(token_id, int) else int(hf.image_token_id)

    def process_item(self, modality: str, item: Any, options: Mapping[str, Any]) -> ProcessedItem:
        """One image through the HF processor's image processor, and the text its placeholder becomes."""
        _check_modality(modality)
        hf = self.info.get_hf_processor()
        merged = hf._merge_kwargs(tokenizer_init_kwargs=hf.tokenizer.init_kwargs, return_tensors="pt", **options)
        try:
            outputs, replacements = hf._process_images([item], **merged["images_kwargs"])
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # what the image processor raises on an input
            raise RequestError(f"the model's image processor ({type(hf).__name__}) refused the image: {exc}",
                               field="multi_modal_data.image") from exc
        unused = set(getattr(hf, "unused_input_names", ()) or ())
        # The tensors (torch's, asked for with return_tensors="pt"); lists such as Idefics3's rows and cols only
        # served the replacement text. (The floor does not import torch: a tensor is known by its methods.)
        data = {name: value for name, value in outputs.items()
                if name not in unused and hasattr(value, "detach") and hasattr(value, "dtype")}
        return ProcessedItem(replacement=replacements[0], data=data)


def _check_modality(modality: str) -> None:
    if modality != IMAGE:
        raise RequestError(f"modality {modality!r} is not supported: images only", field="multi_modal_data")


@dataclass(frozen=True)
class ProcessorFactories:
    """What `register_processor` keeps for a model class (vLLM's _ProcessorFactories)."""

    processor: type[BaseMultiModalProcessor]
    info: type[BaseProcessingInfo]
    dummy_inputs: type[BaseDummyInputsBuilder]

    def build_processor(self, ctx: ProcessingContext) -> BaseMultiModalProcessor:
        info = self.info(ctx)
        return self.processor(info, self.dummy_inputs(info))


DEFAULT_FACTORIES = ProcessorFactories(BaseMultiModalProcessor, BaseProcessingInfo, BaseDummyInputsBuilder)


def class_key(model_cls: type) -> str:
    return f"{model_cls.__module__}:{model_cls.__qualname__}"


class MultiModalRegistry(Registry[ProcessorFactories]):
    """Model class ("module:Class") -> its ProcessorFactories. Registering is idempotent; another processor
    for a registered class is an error naming both, unless `override=True`."""

    def __init__(self) -> None:
        super().__init__("multimodal_processors", "multimodal processor", ProcessorFactories, instances=True)
        self._by_class: dict[type, ProcessorFactories] = {}

    def register_processor(self, processor: type[BaseMultiModalProcessor], *, info: type[BaseProcessingInfo],
                           dummy_inputs: type[BaseDummyInputsBuilder],
                           override: bool = False) -> Callable[[M], M]:
        """A class decorator: the model class it decorates takes `processor` (vLLM's signature)."""
        for name, value, base in (("processor", processor, BaseMultiModalProcessor), ("info", info, BaseProcessingInfo),
                                  ("dummy_inputs", dummy_inputs, BaseDummyInputsBuilder)):
            if not (isinstance(value, type) and issubclass(value, base)):
                raise RegistrationError(f"register_processor: {name} must be a subclass of {base.__name__} "
                                        f"(asyncengine.plugins_api), got {value!r}")
        factories = ProcessorFactories(processor, info, dummy_inputs)

        def decorate(model_cls: M) -> M:
            if not isinstance(model_cls, type):
                raise RegistrationError(f"register_processor decorates a model class, got {model_cls!r}")
            key = class_key(model_cls)
            current = self.get(key)
            if current is not None and current.implementation != factories and not override:
                raise RegistrationError(
                    f"model class {key} already has the multimodal processor {describe(current.implementation.processor)}"
                    f" (registered by {current.owner}); {current_registrant.get()} tried to register "
                    f"{describe(processor)}: pass override=True to replace it")
            # The package's own classes registered on its own models are built-in, whoever imported the module
            # (a plugin's model module that subclasses our LLaVA imports it first).
            ours = all(cls.__module__.startswith("asyncengine.") for cls in (model_cls, processor))
            self.register(key, factories, override=True, owner=BUILT_IN if ours else None)
            self._by_class[model_cls] = factories
            return model_cls

        return decorate

    def factories_for(self, model_cls: type) -> ProcessorFactories | None:
        """The entry of `model_cls` or of the nearest registered class in its MRO; None: none registered."""
        for cls in getattr(model_cls, "__mro__", ()):
            found = self._by_class.get(cls)
            if found is not None:
                return found
        return None

    def has_processor(self, model_cls: type) -> bool:
        return self.factories_for(model_cls) is not None

    def registration(self, model_cls: type, process: str) -> ProcessorFactories:
        """The entry of a multimodal model class (its own or its nearest registered base's), read in `process`
        ("the worker rank 0 (pid 123)"). None is a start-up error naming the class and the process, as vLLM's
        registry fails for a multimodal model with no processor: a registration made in one process (a user's
        script, a frontend-only plugin) does not reach the others."""
        found = self.factories_for(model_cls)
        if found is None:
            raise MissingRegistration(
                f"multimodal model class {class_key(model_cls)} has no processor registered in {self.name!r} "
                f"(MULTIMODAL_REGISTRY) in {process}: decorate the class with "
                "@MULTIMODAL_REGISTRY.register_processor(Processor, info=..., dummy_inputs=...) in its own module "
                "(so every process that imports it has the entry), or register it from a general plugin "
                "(entry-point group asyncengine.general_plugins), which every process loads")
        return found


MULTIMODAL_REGISTRY = MultiModalRegistry()


def items_per_prompt(info: BaseProcessingInfo, configured: Mapping[str, int]) -> dict[str, int]:
    """The most items of each modality one prompt may carry: `configured` (--limit-mm-per-prompt, parsed), capped
    by the model's own limit (`info.get_supported_mm_limits()`) where it has one."""
    limits = dict(configured)
    for modality, model_limit in info.get_supported_mm_limits().items():
        if model_limit is not None and modality in limits and model_limit < limits[modality]:
            limits[modality] = model_limit
    return limits


def supports_multimodal(model_cls: Any) -> bool:
    """vLLM's test: a model class says `supports_multimodal = True` (SupportsMultiModal does), or has a processor
    registered."""
    return getattr(model_cls, "supports_multimodal", False) is True or (
        isinstance(model_cls, type) and MULTIMODAL_REGISTRY.has_processor(model_cls))


__all__ = ["BaseDummyInputsBuilder", "BaseMultiModalProcessor", "BaseProcessingInfo", "DEFAULT_FACTORIES",
           "IMAGE", "MULTIMODAL_REGISTRY", "MultiModalRegistry", "ProcessedItem", "ProcessingContext",
           "ProcessorFactories", "items_per_prompt", "supports_multimodal"]
