"""The worker's reading of MULTIMODAL_REGISTRY (R14): the model class's registration, and the profile with its
dummy inputs (vLLM's `profile_run`; docs/multimodal.md, "Profiling").

When the model is built, a multimodal class (`supports_multimodal`) must have a registration visible in this
process, its own or its nearest registered base's: none fails start-up naming the class and the process
(`registration_in_worker`). When the KV cache is sized, before the language model's profile forward
(`profile_encoder`):

1. the registration's processor is built from the model's folder (as the frontend builds it) and its
   `dummy_inputs` builder makes the largest prompt: `get_dummy_text` and `get_dummy_mm_data` at the most
   images one prompt may carry (`--limit-mm-per-prompt`, capped by the processing info's
   `get_supported_mm_limits()`);
2. each image goes through the processor's `process_item`, as a request's would, and its placeholder text
   gives the embedding rows the model must make for it;
3. the vision encoder (`embed_multimodal`) runs once on as many of the largest image as one step's encoder
   budget admits (vLLM's count: `min(images per prompt x max_num_seqs, budget // rows per image)`, the budget
   `max(max_num_batched_tokens, rows per image)`; on CPU, where no memory is measured, one prompt's images);
   its outputs are checked (one tensor per image, the rows its placeholder takes) and held until the profile
   forward has run, as the encoder cache would hold them, so that on a GPU the peak memory that sizes the KV
   cache includes the encoder's activations and the embeddings it keeps.

The start-up report's `kv cache` phase has a record of it ("multimodal profile").
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.config.multimodal import parse_limit_per_prompt
from asyncengine.errors import RequestError, StartupError
from asyncengine.interfaces.multimodal import embed_multimodal_of
from asyncengine.interfaces.multimodal_registry import (
    IMAGE,
    MULTIMODAL_REGISTRY,
    BaseMultiModalProcessor,
    ProcessedItem,
    ProcessingContext,
    ProcessorFactories,
    class_key,
    items_per_prompt,
)
from asyncengine.interfaces.registry import describe, reads
from asyncengine.wire.startup import StartupRecord

RECORD_NAME = "multimodal profile"  # the start-up record's subject, in the `kv cache` phase


@dataclass
class EncoderProfile:
    """The dummy run's record, and the embeddings it holds until the profile forward has run."""

    record: StartupRecord
    embeddings: list[torch.Tensor] = field(default_factory=list)


@reads("multimodal_processors", "worker")
def registration_in_worker(model_cls: type, process: str) -> tuple[ProcessorFactories, str]:
    """The multimodal model class's registration here and who registered it; none fails start-up, naming the
    class and `process`."""
    factories = MULTIMODAL_REGISTRY.registration(model_cls, process)
    owner = next((entry.owner for cls in model_cls.__mro__
                  if (entry := MULTIMODAL_REGISTRY.get(class_key(cls))) is not None), "?")
    return factories, owner


def profile_encoder(model: Any, factories: ProcessorFactories, owner: str, model_config: Any, engine_config: Any,
                    device: torch.device, role: str) -> EncoderProfile:
    """Run the vision encoder on the registration's dummy inputs (see the module's docstring)."""
    started = time.time()
    processor = factories.build_processor(ProcessingContext(
        str(model_config.model_dir), dict(engine_config.mm_processor_kwargs or {}),
        bool(engine_config.trust_remote_code)))
    who = (f"{describe(factories.processor)} with dummy inputs {describe(factories.dummy_inputs)} "
           f"(registered by {owner})")
    per_prompt = items_per_prompt(processor.info, parse_limit_per_prompt(engine_config.limit_mm_per_prompt))[IMAGE]
    if per_prompt == 0:  # vLLM's zero encoder budget: no image can reach the encoder
        return EncoderProfile(_record(role, started, f"{who}: limit_mm_per_prompt allows no image; the vision "
                                                     "encoder is not profiled", outcome="skipped"))
    items, rows, prompt_tokens = _dummy_prompt(processor, model_config.max_model_len, per_prompt, who)
    largest = max(rows)
    budget = max(engine_config.effective_max_num_batched_tokens, largest)
    count = max(1, min(per_prompt * engine_config.max_num_seqs, budget // largest))
    if device.type == "cpu":  # no memory is measured on CPU: one prompt's images, as a start-up check
        count = min(count, per_prompt)
    order = sorted(range(len(items)), key=lambda index: -rows[index])  # the largest first, then cycled
    chosen = (order + [order[0]] * count)[:count]
    names = list(items[chosen[0]].data)
    kwargs = {name: [items[index].data[name].to(device) for index in chosen] for name in names}
    encoder_started = time.perf_counter()
    with torch.inference_mode():
        embeddings = [rows_.reshape(-1, rows_.shape[-1]) for rows_ in embed_multimodal_of(model, **kwargs)]
    seconds = time.perf_counter() - encoder_started
    model_name = f"{type(model).__module__}:{type(model).__qualname__}"
    if len(embeddings) != count:
        raise StartupError(f"{model_name}.embed_multimodal made {len(embeddings)} embeddings for {count} dummy "
                           f"images of {who}: it must return one tensor per image")
    for index, made in zip(chosen, embeddings):
        if made.shape[0] != rows[index]:
            raise StartupError(f"{model_name}.embed_multimodal made {made.shape[0]} rows for a dummy image of {who} "
                               f"whose placeholder takes {rows[index]}: the model and its processor registration "
                               "disagree")
    held = sum(made.numel() * made.element_size() for made in embeddings)
    over = (f" (over max_model_len {model_config.max_model_len}: such a prompt is refused)"
            if prompt_tokens > model_config.max_model_len else "")
    reason = (f"{who}: {per_prompt} image(s) per prompt, at most {largest} embedding rows per image, the largest "
              f"prompt {prompt_tokens} tokens{over}; the vision encoder ran on {count} image(s) in {seconds:.2f} s "
              f"on {device}, {held / 2**20:.1f} MiB of embeddings held through the profile")
    return EncoderProfile(_record(role, started, reason), embeddings)


def _dummy_prompt(processor: BaseMultiModalProcessor, max_model_len: int, per_prompt: int,
                  who: str) -> tuple[list[ProcessedItem], list[int], int]:
    """The dummy builder's images processed, the embedding rows each takes, and its prompt's length in tokens."""
    builder = processor.dummy_inputs
    counts = {IMAGE: per_prompt}
    text = builder.get_dummy_text(counts)
    images = builder.get_dummy_mm_data(max_model_len, counts).get(IMAGE)
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    placeholder = processor.placeholder(IMAGE)
    if len(images) != per_prompt or text.count(placeholder) != per_prompt:
        raise StartupError(f"{who}: asked for {per_prompt} image(s), the dummy inputs builder gave {len(images)} "
                           f"image(s) and a text with {text.count(placeholder)} placeholder(s) {placeholder!r}: "
                           "get_dummy_text and get_dummy_mm_data must give one each per image asked for")
    options = dict(processor.info.ctx.mm_processor_kwargs)
    done: dict[Any, ProcessedItem] = {}  # the builder's images are often the same blank one: processed once
    items = []
    for image in images:
        is_pil = all(hasattr(image, name) for name in ("mode", "size", "tobytes"))
        key = (image.mode, image.size, image.tobytes()) if is_pil else id(image)
        if key not in done:
            try:
                done[key] = processor.process_item(IMAGE, image, options)
            except RequestError as exc:  # what refuses a request's image refuses the builder's here
                raise StartupError(f"{who}: the processor refused a dummy image: {exc}") from exc
        items.append(done[key])
    tokenizer = processor.info.get_tokenizer()
    embed_id = processor.embed_token_id(IMAGE)
    rows = [list(tokenizer.encode(item.replacement, add_special_tokens=False)).count(embed_id) for item in items]
    if min(rows) == 0:
        raise StartupError(f"{who}: a dummy image's placeholder text has no token {embed_id} (embed_token_id) to "
                           "take its embeddings")
    pieces = text.split(placeholder)
    expanded = pieces[0] + "".join(item.replacement + piece for item, piece in zip(items, pieces[1:]))
    return items, rows, len(tokenizer.encode(expanded, add_special_tokens=False))


def _record(role: str, started: float, reason: str, outcome: str = "ok") -> StartupRecord:
    return StartupRecord(pid=os.getpid(), role=role, phase="kv cache", plugin=RECORD_NAME, outcome=outcome,
                         reason=reason, start=started, duration=time.time() - started)


__all__ = ["EncoderProfile", "RECORD_NAME", "profile_encoder", "registration_in_worker"]
