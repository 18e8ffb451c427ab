"""ModelRunner: keeps each request's tokens and blocks, turns a SchedulerOutput into model inputs,
runs the model and the sampler.

Per step the batch is a flat run of tokens in the scheduler's order. A request samples when the
tokens scheduled for it reach the end of what it has (a decode step, or the last chunk of its
prompt); a request whose prompt is still being prefilled in chunks produces nothing this step.

With logits processors, the rows of the sampled logits follow their persistent layout
(worker/logits_processors.py) instead of the scheduler's order, and they see the layout's changes
(`update_state`) before the sampler applies them. Without any, none of that bookkeeping runs.

One request never fails a step for the others: what the worker builds from a request's own values
(its sampling values as tensors, each logits processor's per-request check) is checked when the
request joins the worker (`_admit`). A request that fails there is reported in the step's
`failed_requests` and left out of the batch; the scheduler ends it with an error, and until it says
to forget it, the steps already scheduled with it skip it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncengine.attention.selector import select_attention_backends
from asyncengine.ops import cpu_build
from asyncengine.config.engine import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from asyncengine.config.model import ModelConfig
from asyncengine.config.lora import parse_lora_modules
from asyncengine.errors import ConfigError, StartupError
from asyncengine.interfaces.kv_connector import KVConnectorBase, KVConnectorRole
from asyncengine.kv_transfer.factory import connector_record, context_for, create_connector
from asyncengine.loader.model_loader import load_model
from asyncengine.lora.peft import LoRAAdapterError
from asyncengine.lora.pool import LoRAPool
from asyncengine.interfaces.lora_resolver import LoRARequest
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.models.layers.fused_moe import ExpertLoad
from asyncengine.wire.startup import StartupRecord
from asyncengine.plugin_runtime.records import current_process_role
from asyncengine.interfaces.plugin_code import plugin_hook
from asyncengine.pooling.step import PoolingStep, build_pooling_step, encoder_num_blocks, set_token_type_ids
from asyncengine.wire.pooling import PoolingOptions
from asyncengine import parallel_state as parallel
from asyncengine.worker.cpu_decode import CpuDecodeStep
from asyncengine.worker.cuda_graphs import DecodeGraphs
from asyncengine.worker import kv_cache
from asyncengine.worker.input_batch import BlockTableRows, StagingBuffers
from asyncengine.worker.logit_controls import RequestLogitControls
from asyncengine.interfaces.logits import BatchUpdate
from asyncengine.worker.logits_processors import LogitsProcessorRequestError, LogitsProcessors
from asyncengine.worker.multimodal import MultiModalStep, check_features, mrope_positions, uses_mrope
from asyncengine.interfaces.multimodal import supports_multimodal
from asyncengine.wire.multimodal import MultiModalFeature
from asyncengine.worker.pipeline import receive_sampled_tokens, share_sampled_tokens, take_token_ids
from asyncengine.worker.sampler import Sampler, SamplingRow
from asyncengine.worker.spec_decode.verifier import SpecDecoder, proposer_context
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.structured_output.bitmask import apply_bitmask
from asyncengine.wire.kv_cache import KVCacheLayout
from asyncengine.wire.worker import (
    FailedRequest,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepTimings,
)

if TYPE_CHECKING:
    from asyncengine.interfaces.platform import Platform


logger = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: the logits processors' row layout keys on the state object
class RequestState:
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt, then every token sampled so far
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingOptions
    # Every token sampled so far, as a list of its own: logits processors are handed this list once
    # (BatchUpdate.added) and read it as it grows, as vLLM's are.
    output_token_ids: list[int] = field(default_factory=list)
    row: int = -1  # this request's row of the persistent block tables (input_batch.BlockTableRows)
    # logit_bias, allowed_token_ids, bad_words as device tensors, built once when it joins (None without any).
    logit_controls: RequestLogitControls | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (lora/pool.py), None: the base model
    pooling: PoolingOptions | None = None  # a pooling request: pooled after its prompt (pooling/step.py)
    # The blocks of the KV cache groups after the first (sliding-window layers: asyncengine/wire/kv_cache.py).
    extra_block_ids: list[list[int]] = field(default_factory=list)
    mm_features: list[MultiModalFeature] | None = None  # its images (worker/multimodal.py), None: text only
    mrope: tuple[torch.Tensor, int] | None = None  # M-RoPE models: its prompt's (3, n) positions and the delta


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 platform: type[Platform], logits_processors: Sequence[type] = ()) -> None:
        self.engine_config = engine_config
        self.model_config = model_config
        self.device = device
        self.platform = platform
        self.pin_memory = device.type != "cpu" and platform.is_pin_memory_available()
        self.block_size = engine_config.block_size
        self.dtype = getattr(torch, model_config.dtype)
        self.requests: dict[str, RequestState] = {}
        # Requests this worker refused (_admit) that the scheduler has not told it to forget yet.
        self.failed_request_ids: set[str] = set()
        # The loaded model, from load_model on: an nn.Module with forward(input_ids, positions, metadata) and
        # compute_logits(hidden), ours or a plugin's, with no common base class that declares them.
        self.model: Any = None
        self.expert_load = ExpertLoad(None)  # tokens per expert, for /metrics (MoE models): set with the model
        self.attention_layers: list[PagedAttention] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Which attention layers share block tables and memory (worker/kv_cache.py), from the engine core; one
        # group of every layer until it says otherwise.
        self.kv_layout: KVCacheLayout | None = None
        self.num_blocks = 0
        self.sampler = Sampler(model_config.vocab_size, device, engine_config.seed)
        self.logits_processor_classes = list(logits_processors)
        self.logits_processors: LogitsProcessors | None = None  # built with the model
        # What this worker chose while loading (the attention backend, ...), for the start-up report:
        # the engine core adds them to its trace under this process's name (Worker.load_model).
        self.startup_records: list[StartupRecord] = []
        # The KV cache's size and the C kernels the warm-up built or loaded (initialize_kv_cache).
        self.kv_cache_records: list[StartupRecord] = []
        self.kv_connector: KVConnectorBase | None = None  # built with the model when kv_transfer_config is set
        self.block_rows = BlockTableRows(-(-model_config.max_model_len // self.block_size))
        self.staging = StagingBuffers(device, self.pin_memory)
        self.decode_graphs: DecodeGraphs | None = None  # captured after the KV cache, where the platform allows
        self.cpu_decode: CpuDecodeStep | None = None  # small CPU decode steps as one C call (worker/cpu_decode.py)
        self.pooling_step: PoolingStep | None = None  # with the model, when it can pool (pooling/step.py)
        self.lora: LoRAPool | None = None  # the adapter slots, with enable_lora (lora/pool.py)
        self.multimodal: MultiModalStep | None = None  # with a multimodal model: its encoder cache and merge
        self.uses_mrope = False  # the model reads (3, num_tokens) positions (worker/multimodal.py)
        # Speculative decoding (worker/spec_decode/verifier.py): with speculative_config, built with the model.
        self.spec_decoder: SpecDecoder | None = None

    # -- start-up ----------------------------------------------------------------------------------------

    def load_model(self) -> None:
        started = time.time()
        self.model = load_model(
            self.model_config,
            device=self.device,
            load_format=self.engine_config.load_format,
            model_class_overrides=self.engine_config.model_class_overrides,
            seed=self.engine_config.seed,
            quantization=self.engine_config.quantization,
            engine_config=self.engine_config,
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.startup_records.append(StartupRecord(
            pid=os.getpid(), role=current_process_role(), phase="load model", plugin="model weights",
            reason=(f"{self.model_config.architectures[0]} in {str(self.dtype).removeprefix('torch.')} on "
                    f"{self.device}: {_size(weight_bytes)} of weights, loaded in "
                    f"{time.time() - started:.1f} s"),
            start=started, duration=time.time() - started))
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.expert_load = ExpertLoad(self.model)
        if supports_multimodal(self.model):
            if self.engine_config.enable_lora:  # its steps with images would run without the adapters
                raise ConfigError(f"LoRA adapters on a multimodal model ({self.model_config.architectures[0]}) are "
                                  "not supported yet: start it without enable_lora", field="enable_lora")
            self.multimodal = MultiModalStep(self.model, self.device)
        self.uses_mrope = uses_mrope(self.model)
        if self.engine_config.enable_lora:  # wrapped after loading: the checkpoint's names stay the base layers'
            config = self.engine_config
            num_layers = int(self.model_config.hf_config["num_hidden_layers"])
            start, end = parallel.stage_layers(num_layers)
            self.lora = LoRAPool.wrap(self.model, hidden_size=int(self.model_config.hf_config["hidden_size"]),
                                      other_stage_layers=frozenset(range(num_layers)) - frozenset(range(start, end)),
                                      max_loras=config.max_loras, max_rank=config.max_lora_rank,
                                      max_cpu_loras=config.max_cpu_loras or config.max_loras, device=self.device,
                                      dtype=self.dtype, model_name=self.model_config.served_model_name)
            for module in parse_lora_modules(config.lora_modules):  # an adapter that does not fit: no start-up
                try:
                    self.lora.check(module.name, module.path)
                except LoRAAdapterError as exc:
                    raise ConfigError(f"lora_modules {module.name}: {exc}", field="lora_modules") from None
        started = time.time()
        choice = select_attention_backends(self.platform, self.attention_layers, self.dtype, self.block_size,
                                           self.engine_config.attention_backend)
        for layer, backend in zip(self.attention_layers, choice.backends):
            layer.backend = backend
        logger.info("attention backend: %s", choice.summary())
        self.startup_records.append(StartupRecord(
            pid=os.getpid(), role=current_process_role(), phase="load model", plugin="attention backend",
            reason=choice.summary(), start=started, duration=time.time() - started))
        self.pooling_step = build_pooling_step(self.model, self.model_config, self.startup_records,
                                               current_process_role())
        self.logits_processors = LogitsProcessors.build(
            self.logits_processor_classes, self.engine_config, self.device, self.pin_memory
        )
        speculative = self.engine_config.speculative
        if speculative is not None:
            if self.logits_processors is not None:
                raise ConfigError("speculative_config does not run with logits processors yet (their per-request row "
                                  "layout has one row per request, verification one per drafted position); start "
                                  "without logits_processors (and logits-processor plugins), or without speculation",
                                  field="speculative_config")
            self.spec_decoder = SpecDecoder(speculative, proposer_context(
                self.engine_config, self.model_config.vocab_size, self.model_config.max_model_len, self.device,
                dtype=self.dtype, block_size=self.block_size, platform=self.platform))
            self.spec_decoder.load_model(self.model)
            self.startup_records.append(self.spec_decoder.record)
        kv_transfer = self.engine_config.kv_transfer
        if kv_transfer is not None:  # the worker side of the KV connector; it gets the cache once allocated
            started = time.time()
            self.kv_connector, choice = create_connector(
                kv_transfer, KVConnectorRole.WORKER,
                context_for(self.engine_config, self.model_config, rank=parallel.rank()))
            self.startup_records.append(connector_record(self.kv_connector, choice, phase="load model",
                                                         started=started))

    def kv_cache_spec(self) -> list[list[int | None]]:
        """`[layer index, sliding window]` of each attention layer here: the engine core builds the layout from them."""
        return kv_cache.layer_spec(self.attention_layers)

    def set_kv_cache_layout(self, layout: KVCacheLayout | None) -> KVCacheLayout:
        """Take the engine core's layout (None: one group of every layer), before the cache is sized."""
        if layout is None:
            layout = kv_cache.local_layout(self.attention_layers)
        kv_cache.apply_layout(self.attention_layers, layout)  # a layout that does not fit fails here, named
        self.kv_layout = layout
        if self.block_rows.num_groups != len(layout.groups):
            self.block_rows = BlockTableRows(-(-self.model_config.max_model_len // self.block_size),
                                             num_groups=len(layout.groups))
        return layout

    def kv_cache_bytes_per_block(self) -> int:
        """What one block takes of the KV budget: the target's layers', and a speculative draft's (a head's)
        own cache's, which gets a block per target block."""
        layout = self.kv_layout or self.set_kv_cache_layout(None)
        draft = self.spec_decoder.kv_cache_bytes_per_block(self.block_size) if self.spec_decoder is not None else 0
        return kv_cache.bytes_per_block(self.attention_layers, layout, self.block_size, self.dtype) + draft

    def determine_num_blocks(self, layout: KVCacheLayout | None = None) -> int:
        """How many KV blocks to allocate: the override, else the byte budget, else what memory allows."""
        if layout is not None or self.kv_layout is None:
            self.set_kv_cache_layout(layout)
        config = self.engine_config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if not self.attention_layers:  # an encoder keeps no KV cache: block ids without memory
            return encoder_num_blocks(config, self.model_config)
        per_block = self.kv_cache_bytes_per_block()
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cpu":
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        else:
            budget = self._device_kv_budget()
        return max(0, budget // per_block)

    def _device_kv_budget(self) -> int:
        """The memory left under gpu_memory_utilization after the weights and a peak-sized forward pass."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.engine_config.effective_max_num_batched_tokens, self.model_config.max_model_len)
        self._profile_forward(num_tokens)
        with plugin_hook(self.platform, "get_current_memory_usage"):
            peak = self.platform.get_current_memory_usage(self.device)
        with plugin_hook(self.platform, "get_device_total_memory"):
            total = self.platform.get_device_total_memory(self.device)
        return int(total * self.engine_config.gpu_memory_utilization) - peak

    def _profile_forward(self, num_tokens: int, sampling: SamplingOptions | None = None) -> None:
        num_blocks = -(-num_tokens // self.block_size)
        self._allocate_kv_cache(num_blocks)
        state = RequestState([0] * num_tokens, [0] * num_tokens, list(range(num_blocks)), 0,
                             sampling or SamplingOptions(),
                             extra_block_ids=[list(range(num_blocks)) for _ in range(self.block_rows.num_groups - 1)])
        if self.model_config.runner == "pooling":  # a pooling model has no LM head: it profiles its pooler
            state.pooling = PoolingOptions(task="encode")
        self._add_request("__profile__", state)
        # The profile's dummy request is nobody's: logits processors and a KV connector never see it.
        processors, self.logits_processors = self.logits_processors, None
        connector, self.kv_connector = self.kv_connector, None
        spec_decoder, self.spec_decoder = self.spec_decoder, None
        try:
            self.execute_model(SchedulerOutput(num_scheduled_tokens={"__profile__": num_tokens}))
        finally:
            self.logits_processors = processors
            self.kv_connector = connector
            self.spec_decoder = spec_decoder
            self._remove_request("__profile__")
            self.kv_caches = []
            for layer in self.attention_layers:
                layer.kv_cache = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def initialize_kv_cache(self, num_blocks: int, layout: KVCacheLayout | None = None) -> None:
        if layout is not None or self.kv_layout is None:
            self.set_kv_cache_layout(layout)
        max_len = self.model_config.max_model_len
        needed = kv_cache.blocks_for_one_sequence(self.kv_layout, max_len, self.block_size,
                                                  self.engine_config.effective_max_num_batched_tokens)
        if num_blocks < needed:
            raise StartupError(
                f"the KV cache has room for {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens), less than one sequence of max_model_len={max_len} "
                "needs; raise kv_cache_memory_bytes (or gpu_memory_utilization), or lower max_model_len"
            )
        self.kv_cache_records = []
        if self.device.type == "cpu":
            self._warm_up()  # before the cache: the warm-up's own small one is freed first
        self._allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.kv_cache_records.append(self._kv_cache_record(num_blocks, needed))
        if self.spec_decoder is not None:  # beside the target's: as many blocks
            record = self.spec_decoder.initialize_kv_cache(num_blocks)
            if record is not None:
                self.kv_cache_records.append(record)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self._decode_graphs_allowed():
            self.enable_decode_graphs(capture=True)
        if self.device.type == "cpu" and self.model_config.runner != "pooling" and not self._reads_layer_states():
            started = time.time()
            self.cpu_decode, detail = CpuDecodeStep.build(self.model, self.attention_layers, self.dtype,
                                                          self.engine_config)
            logger.info("CPU decode step: %s", detail if self.cpu_decode else f"not used ({detail})")
            self.kv_cache_records.append(StartupRecord(
                pid=os.getpid(), role=current_process_role(), phase="kv cache", plugin="CPU decode step",
                outcome="ok" if self.cpu_decode else "skipped", reason=detail, start=started,
                duration=time.time() - started))
        self.expert_load.reset()  # the profile's, warm-up's and captures' dummy tokens are nobody's load

    def _warm_up(self) -> None:
        """One forward pass of a block's worth of tokens, so that what the first request would otherwise
        do is done at start-up: above all, build or load the C kernels its layers use (ops/cpu_build.py,
        a minute on a fresh machine). Greedy, and the random state restored: it changes no output."""
        started, first_event = time.time(), len(cpu_build.KERNEL_EVENTS)
        with torch.random.fork_rng(devices=[]):
            self._profile_forward(min(self.block_size, self.model_config.max_model_len),
                                  SamplingOptions(temperature=0.0))
        role = current_process_role()
        for event in cpu_build.KERNEL_EVENTS[first_event:]:
            self.kv_cache_records.append(StartupRecord(
                pid=os.getpid(), role=role, phase="kv cache", plugin=f"C kernels {event.name}",
                outcome="skipped" if event.outcome == "unavailable" else "ok",
                reason=f"{event.outcome}: {event.detail}", start=started, duration=event.seconds))
        logger.info("warm-up forward pass in %.1f s", time.time() - started)

    def _kv_cache_record(self, num_blocks: int, blocks_per_sequence: int) -> StartupRecord:
        """What the KV cache holds, in vLLM's terms: blocks, bytes, tokens, and the maximum concurrency at
        max_model_len (how many sequences of that length fit at once)."""
        num_bytes = sum(key.nbytes + value.nbytes for key, value in self.kv_caches)
        max_len = self.model_config.max_model_len
        detail = (f"{num_blocks:,} blocks of {self.block_size} tokens ({num_blocks * self.block_size:,} tokens), "
                  f"{_size(num_bytes)} in {str(self.dtype).removeprefix('torch.')}; maximum concurrency "
                  f"for {max_len:,} tokens per request: {num_blocks / max(1, blocks_per_sequence):.2f}x")
        return StartupRecord(pid=os.getpid(), role=current_process_role(), phase="kv cache", plugin="KV cache",
                             reason=detail, start=time.time())

    def _decode_graphs_allowed(self) -> bool:
        """CUDA graphs for decode: on a CUDA device, unless enforce_eager, with one worker (collectives
        stay out of graphs), and only over attention backends that say they are safe to capture."""
        return (self.device.type == "cuda" and not self.engine_config.enforce_eager
                and self.engine_config.tensor_parallel_size == 1
                and self.engine_config.pipeline_parallel_size == 1
                and self.lora is None  # the adapters' per-step assignment is not in the captured buffers
                and getattr(self.model, "supports_cuda_graphs", True)  # the transformers backend's is False
                and self.model_config.runner != "pooling"  # a pooling model never decodes
                and not self._reads_layer_states()  # EAGLE-3's hooks on the target's layers
                and self.block_rows.num_groups == 1  # the graphs' buffers hold one block table per sequence
                and all(getattr(layer.backend, "cuda_graph_safe", False) for layer in self.attention_layers))

    def _reads_layer_states(self) -> bool:
        return self.spec_decoder is not None and self.spec_decoder.reads_layer_states

    def enable_decode_graphs(self, *, capture: bool) -> None:
        """Run decode steps through static buffers padded to fixed batch sizes (cuda_graphs.py), captured
        as CUDA graphs when `capture`; without, the same padded path runs eagerly (how it is tested on CPU)."""
        started = time.time()
        graphs = DecodeGraphs(self.model, self.device, max_batch_size=self.engine_config.max_num_seqs,
                              max_blocks_per_seq=-(-self.model_config.max_model_len // self.block_size),
                              block_size=self.block_size, capture=capture)
        if capture:
            with self.platform.inference_mode():
                graphs.capture()
        self.decode_graphs = graphs
        logger.info("decode CUDA graphs: batch sizes %s (%s) in %.1f s", graphs.sizes,
                    "captured" if capture else "not captured: eager over the same padded buffers",
                    time.time() - started)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layout = self.kv_layout or self.set_kv_cache_layout(None)
        self.kv_caches = kv_cache.allocate(self.attention_layers, layout, num_blocks, self.block_size, self.dtype,
                                           self.device)

    # -- one step ----------------------------------------------------------------------------------------

    def _add_request(self, request_id: str, state: RequestState) -> None:
        self._remove_request(request_id)  # a preempted request comes back as new: it gets a fresh row
        state.row = self.block_rows.add(state.block_ids, state.extra_block_ids)
        self.requests[request_id] = state

    def _remove_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.block_rows.release(state.row)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(request_id)

    def _update_states(self, scheduler_output: SchedulerOutput) -> list[FailedRequest]:
        """Apply the step's changes; the new requests this worker refused (see `_admit`)."""
        failed = []
        for request_id in scheduler_output.finished_request_ids:
            self._remove_request(request_id)
            self.failed_request_ids.discard(request_id)
        for new in scheduler_output.new_requests:
            failure = self._admit(new)
            if failure is not None:
                self._remove_request(new.request_id)  # a resumed request may have left an older state
                self.failed_request_ids.add(new.request_id)
                failed.append(failure)
                continue
            self._add_request(new.request_id, RequestState(
                prompt_token_ids=list(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                pooling=new.pooling,
                output_token_ids=list(new.output_token_ids),
                logit_controls=RequestLogitControls.build(new.sampling, self.model_config.vocab_size, self.device),
                lora_request=new.lora_request,
                extra_block_ids=[list(ids) for ids in new.extra_group_block_ids or ()],
                mm_features=new.mm_features,
            ))
        for cached in scheduler_output.cached_requests:
            if cached.request_id in self.failed_request_ids:
                continue  # scheduled again before the scheduler learnt it failed
            state = self.requests[cached.request_id]
            for group, length in enumerate(cached.block_table_lengths or ()):  # (speculative decoding's trims)
                del (state.block_ids if group == 0 else state.extra_block_ids[group - 1])[length:]
                self.block_rows.truncate(state.row, length, group)
            state.block_ids.extend(cached.new_block_ids)
            self.block_rows.append(state.row, cached.new_block_ids)
            for group, ids in enumerate(cached.extra_group_block_ids or (), start=1):
                state.extra_block_ids[group - 1].extend(ids)
                self.block_rows.append(state.row, ids, group)
            state.num_computed_tokens = cached.num_computed_tokens
        if scheduler_output.pipeline_token_ids is not None and not parallel.is_last_stage():
            take_token_ids(self.requests, scheduler_output.pipeline_token_ids)  # micro-batches (pipeline.py)
        return failed

    def _admit(self, new: NewRequestData) -> FailedRequest | None:
        """Check what this worker builds from one request's own values, where failing fails only it: each
        logits processor's check_request, and its LoRA adapter. (Its sampling values need no check here: the
        frontend checked them where they entered, and the wire's SamplingOptions carries their bounds.)"""
        if new.mm_features:
            problem = (check_features(new.mm_features, len(new.prompt_token_ids)) if self.multimodal is not None
                       else f"{self.model_config.architectures[0]} takes no images")
            if problem is not None:
                return FailedRequest(request_id=new.request_id, field="multi_modal_data", message=problem)
        if self.uses_mrope:  # images that overlap or do not fit fail here, not in a step (the model's positions)
            try:
                self.model.get_mrope_input_positions(list(new.prompt_token_ids), list(new.mm_features or ()))
            except ValueError as exc:
                return FailedRequest(request_id=new.request_id, field="multi_modal_data", message=str(exc))
        try:
            if self.logits_processors is not None:
                self.logits_processors.check_request(new.sampling)
            if new.lora_request is not None:
                if self.lora is None:
                    return FailedRequest(request_id=new.request_id, field="lora_request",
                                         message="this engine was started without enable_lora: it serves no adapters")
                self.lora.add(new.lora_request)  # read and checked now: a bad adapter fails only this request
        except LoRAAdapterError as exc:
            return FailedRequest(request_id=new.request_id, field="lora_request", message=str(exc))
        except LogitsProcessorRequestError as exc:
            if not isinstance(exc.error, ValueError):  # a refusal is a ValueError; anything else may be a bug
                logger.warning("%s (request %s)", exc, new.request_id, exc_info=exc.error)
            return FailedRequest(request_id=new.request_id, field="extra_args", message=str(exc))
        return None

    def execute_model(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> ModelRunnerOutput:
        """One step. `grammar` (a structured_output.deferred.DeferredMask) brings the masks of a step
        submitted with `deferred_grammar_request_ids`: waited on only once the logits are computed."""
        with self.platform.inference_mode():
            return self._execute(scheduler_output, grammar)

    def _execute(self, scheduler_output: SchedulerOutput, grammar: Any = None) -> ModelRunnerOutput:
        failed = self._update_states(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        if self.failed_request_ids:
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in self.failed_request_ids}
        multimodal = self.multimodal
        mm_features: dict[str, list[MultiModalFeature]] = {}
        if multimodal is not None and parallel.is_first_stage():  # frees, then this step's images (vision tower)
            mm_features = {rid: state.mm_features for rid, state in self.requests.items() if state.mm_features}
            multimodal.run_encoders(scheduler_output, mm_features)
        if not scheduled:
            return ModelRunnerOutput(failed_requests=failed)
        connector_metadata = None
        if self.kv_connector is not None and scheduler_output.kv_connector_metadata is not None:
            # Before the forward pass: the blocks the scheduler counted as computed must hold their KV.
            connector_metadata = self.kv_connector.decode_metadata(scheduler_output.kv_connector_metadata)
            self.kv_connector.start_load_kv(connector_metadata)
        started = time.perf_counter()
        computed = ({rid: self.requests[rid].num_computed_tokens for rid in scheduled}
                    if mm_features or self.uses_mrope else {})  # (nothing on a text-only model's path)
        inputs = self._prepare_inputs(scheduled, scheduler_output.spec_token_ids)
        # A step that computes image positions runs on merged embeddings, eagerly (never a decode graph).
        inputs_embeds = (multimodal.inputs_embeds(scheduled, computed, mm_features, inputs.input_ids)
                         if multimodal is not None and mm_features else None)
        positions = inputs.positions
        if self.uses_mrope:  # 3-D positions for the model (the 1-D ones still place the tokens' KV slots)
            positions = mrope_positions(self.model, scheduled, computed, self.requests).to(self.device)
        prepared = time.perf_counter()
        events = self._device_events()
        if events is not None:
            events[0].record()
        graphs = self.decode_graphs
        logits: torch.Tensor | None = None  # the C decode step's, when it ran the LM head too
        use_graph = (graphs is not None and inputs.metadata.decode_only
                     and len(inputs.metadata.query_lens) <= graphs.max_batch_size)
        if inputs_embeds is not None or self.uses_mrope:  # eagerly: no decode graph or C decode step takes these
            hidden = self.model(inputs.input_ids, positions, inputs.metadata, inputs_embeds=inputs_embeds)
        elif graphs is not None and use_graph:
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        elif self.cpu_decode is not None and self.cpu_decode.applies(inputs.metadata):
            hidden, logits = self.cpu_decode.run(inputs.input_ids, inputs.positions, inputs.metadata)
        elif self.lora is not None:
            self.lora.begin_step((self.requests[rid].lora_request, n) for rid, n in scheduled.items())
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            finally:
                self.lora.end_step()
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if events is not None:
            events[1].record()
        forwarded = time.perf_counter()
        if self.spec_decoder is not None:  # the target's states, for a proposer reading them (EAGLE)
            self.spec_decoder.take_states(hidden, scheduled)
        if self.kv_connector is not None and connector_metadata is not None:
            self.kv_connector.wait_for_save(connector_metadata)
        if not parallel.is_last_stage():  # pipeline parallelism: the last stage samples (worker/pipeline.py)
            if scheduler_output.pipeline_token_ids is not None:  # micro-batches: the tokens come with a later step
                return ModelRunnerOutput(timings=self._timings(started, prepared, forwarded, events, use_graph),
                                         failed_requests=failed)
            token_ids = receive_sampled_tokens(len(inputs.sampling_request_ids), self.device)
            for request_id, token_id in zip(inputs.sampling_request_ids, token_ids):
                self.requests[request_id].token_ids.append(token_id)
                self.requests[request_id].output_token_ids.append(token_id)
            return ModelRunnerOutput(request_ids=inputs.sampling_request_ids, sampled_token_ids=token_ids,
                                     timings=self._timings(started, prepared, forwarded, events, use_graph),
                                     failed_requests=failed)
        if not inputs.sampling_request_ids:
            return self._with_pooled(hidden, inputs, ModelRunnerOutput(
                timings=self._timings(started, prepared, forwarded, events, use_graph), failed_requests=failed))
        logits = self.model.compute_logits(hidden[inputs.logits_indices]) if logits is None \
            else logits[inputs.logits_indices]
        bitmask = scheduler_output.grammar_bitmask
        if scheduler_output.deferred_grammar_request_ids is not None:
            if grammar is None:
                raise RuntimeError("this step's grammar masks follow it (deferred_grammar_request_ids), but its "
                                   "executor handed the worker nothing to wait on: only an executor whose "
                                   "supports_deferred_grammar is true may send such a step")
            bitmask = grammar.wait()  # the engine core computes them while the forward pass above ran
        if inputs.drafts is not None:  # speculative decoding: rows per verified position
            if bitmask is not None:  # (a constrained request verifies no drafts: its one row is its last)
                logits = self._apply_grammar_bitmask(
                    logits, [rid for rid, own in zip(inputs.sampling_request_ids, inputs.drafts)
                             for _ in range(len(own) + 1)], bitmask)
            output = self._verified(hidden, logits, inputs, ModelRunnerOutput(failed_requests=failed))
            output.timings = self._timings(started, prepared, forwarded, events, use_graph)  # (verification in `sample`)
            return output
        if bitmask is not None:
            logits = self._apply_grammar_bitmask(logits, inputs.sampling_request_ids, bitmask)
        rows = []
        for request_id in inputs.sampling_request_ids:
            state = self.requests[request_id]
            rows.append(SamplingRow(state.sampling, state.prompt_token_ids, state.output_token_ids,
                                    state.logit_controls))
        processors = self.logits_processors
        if processors is not None:
            # Every token sampled before this step is in each request's output list by now: steps
            # run one after another on this thread, whatever the engine core scheduled ahead.
            processors.update_state(inputs.batch_update)
        sampled = self.sampler(logits, rows, processors)
        if scheduler_output.pipeline_token_ids is None:  # (with micro-batches the engine core sends them)
            share_sampled_tokens(sampled.token_ids, self.device)
        for request_id, token_id in zip(inputs.sampling_request_ids, sampled.token_ids):
            state = self.requests[request_id]
            state.token_ids.append(token_id)
            state.output_token_ids.append(token_id)
        output = ModelRunnerOutput(
            request_ids=inputs.sampling_request_ids, sampled_token_ids=sampled.token_ids, logprobs=sampled.logprobs,
            timings=self._timings(started, prepared, forwarded, events, use_graph), failed_requests=failed,
        )
        if self.spec_decoder is not None:  # drafts for the next step (worker/spec_decode/verifier.py)
            self.spec_decoder.propose_into(output, self.requests)
        return self._with_pooled(hidden, inputs, output)

    def _verified(self, hidden: torch.Tensor, logits: torch.Tensor, inputs: "_StepInputs",
                  output: ModelRunnerOutput) -> ModelRunnerOutput:
        """A step with drafts: the rejection test over every verified position, the emitted tokens
        appended, and the next drafts proposed (worker/spec_decode/verifier.py)."""
        if self.spec_decoder is None or inputs.drafts is None:
            raise RuntimeError("a step with drafts (spec_token_ids) reached a worker built without speculative_config")
        self.spec_decoder.verify_step(logits, inputs.sampling_request_ids, inputs.drafts, self.requests, self.sampler,
                                      output)
        return self._with_pooled(hidden, inputs, output)

    def _with_pooled(self, hidden: torch.Tensor, inputs: "_StepInputs", output: ModelRunnerOutput) -> ModelRunnerOutput:
        """The step's pooling requests whose prompt it finished get their pooled outputs (pooling/step.py)."""
        if inputs.pooling_spans and self.pooling_step is None:  # (the frontend refuses these first)
            output.failed_requests = [*output.failed_requests, *(
                FailedRequest(request_id=rid, field="model", message="this model has no pooler: it cannot pool")
                for rid, _, _ in inputs.pooling_spans)]
        elif inputs.pooling_spans and self.pooling_step is not None:
            output.pooled_request_ids = [request_id for request_id, _, _ in inputs.pooling_spans]
            output.pooled = self.pooling_step.run(hidden, inputs.pooling_spans, self.requests)
        return output

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, sampling_ids: list[str], bitmask: GrammarBitmask) -> torch.Tensor:
        """Structured outputs: the engine core's masks on the constrained rows, in one vectorised operation,
        before any sampling step (penalties, processors, temperature) sees the logits."""
        row_of = {request_id: row for row, request_id in enumerate(sampling_ids)}
        # A request failed in this worker meanwhile has a mask but no row: its mask is skipped.
        pairs = [(index, row_of[rid]) for index, rid in enumerate(bitmask.request_ids) if rid in row_of]
        if not pairs:
            return logits
        return apply_bitmask(logits, bitmask.words, bitmask.num_words, pairs)

    def _device_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Two timing events around the forward pass on a CUDA device (recording one costs microseconds)."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    @staticmethod
    def _timings(started: float, prepared: float, forwarded: float,
                 events: tuple[torch.cuda.Event, torch.cuda.Event] | None, cuda_graph: bool) -> StepTimings:
        finished = time.perf_counter()
        device_forward = -1.0
        if events is not None:
            events[1].synchronize()  # already done when the step sampled (the read-back waited for it)
            device_forward = events[0].elapsed_time(events[1]) / 1000
        return StepTimings(prepared - started, forwarded - prepared, finished - forwarded, device_forward, cuda_graph)

    def _prepare_inputs(self, scheduled: dict[str, int],
                        spec_token_ids: dict[str, list[int]] | None = None) -> "_StepInputs":
        """The step's model inputs for `scheduled` (request id -> tokens to compute, in batch order),
        built in the staging buffers and sent to the device in one copy each.

        The only per-request Python work is reading each request's new tokens and lengths; positions,
        slots and block tables are computed for the whole batch at once with numpy."""
        block_size = self.block_size
        num_seqs = len(scheduled)
        total = sum(scheduled.values())
        staging = self.staging
        staging.begin_step()
        input_ids = staging.array("input_ids", total, torch.int64)
        rows = np.empty(num_seqs, dtype=np.int64)
        starts = np.empty(num_seqs, dtype=np.int64)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_ids: list[str] = []
        pooling_spans: list[tuple[str, int, int]] = []
        # Speculative decoding: per sampling request, the drafts it verifies (None: no drafts in this step).
        drafts: list[list[int]] | None = [] if spec_token_ids else None
        offset = 0
        for index, (request_id, num_tokens) in enumerate(scheduled.items()):
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            own = spec_token_ids.get(request_id) if spec_token_ids else None
            if own:  # its last sampled token, then its drafts (the scheduler counted them in num_tokens)
                input_ids[offset : offset + num_tokens] = state.token_ids[start:] + own
                rows[index] = state.row
                starts[index] = start
                query_lens.append(num_tokens)
                seq_lens.append(end)
                offset += num_tokens
                logits_indices.extend(range(offset - len(own) - 1, offset))
                sampling_ids.append(request_id)
                if drafts is not None:
                    drafts.append(own)
                continue
            if num_tokens == 1:
                input_ids[offset] = state.token_ids[start]
            else:
                input_ids[offset : offset + num_tokens] = state.token_ids[start:end]
            rows[index] = state.row
            starts[index] = start
            query_lens.append(num_tokens)
            seq_lens.append(end)
            offset += num_tokens
            if end == len(state.token_ids) and state.pooling is not None:
                pooling_spans.append((request_id, offset - num_tokens, offset))  # pooled, never sampled
            elif end == len(state.token_ids):
                logits_indices.append(offset - 1)
                sampling_ids.append(request_id)
                if drafts is not None:
                    drafts.append([])
        batch_update = None
        if self.logits_processors is not None and sampling_ids:
            sampling_ids, logits_indices, batch_update = self._arrange_rows(sampling_ids, logits_indices)

        lengths = np.asarray(query_lens, dtype=np.int64)
        query_start_loc = staging.array("query_start_loc", num_seqs + 1, torch.int32)
        query_start_loc[0] = 0
        np.cumsum(lengths, out=query_start_loc[1:])
        # Token t of sequence b sits at position starts[b] + (t - query_start_loc[b]).
        positions = staging.array("positions", total, torch.int64)
        positions[:] = np.arange(total) + np.repeat(starts - query_start_loc[:-1], lengths)
        max_seq_len = max(seq_lens)
        width = -(-max_seq_len // block_size)
        tables = self.block_rows.gather(rows, width)
        slots = staging.array("slot_mapping", total, torch.int64)
        token_seqs = np.repeat(np.arange(num_seqs), lengths)
        block_of_token = tables[token_seqs, positions // block_size]
        slots[:] = block_of_token * block_size + positions % block_size
        staging.array("block_tables", num_seqs * width, torch.int64)[:] = tables.ravel()
        staging.array("seq_lens", num_seqs, torch.int32)[:] = seq_lens
        staging.array("logits_indices", len(logits_indices), torch.int64)[:] = logits_indices

        block_tables = staging.to_device("block_tables", num_seqs * width).view(num_seqs, width)
        inputs = _StepInputs(
            input_ids=staging.to_device("input_ids", total),
            positions=staging.to_device("positions", total),
            metadata=AttentionMetadata(
                staging.to_device("slot_mapping", total), None, query_lens, seq_lens, block_tables,
                block_size=block_size,
                query_start_loc=staging.to_device("query_start_loc", num_seqs + 1),
                seq_lens_tensor=staging.to_device("seq_lens", num_seqs),
                max_query_len=int(lengths.max()),
                max_seq_len=max_seq_len,
            ),
            logits_indices=staging.to_device("logits_indices", len(logits_indices)),
            sampling_request_ids=sampling_ids,
            pooling_spans=pooling_spans,
            batch_update=batch_update,
            drafts=drafts,
        )
        if self.block_rows.num_groups > 1:
            inputs.metadata.group_metadata = [inputs.metadata] + [
                kv_cache.group_metadata(self.block_rows.gather(rows, width, group), token_seqs, positions,
                                        inputs.metadata, self.device)
                for group in range(1, self.block_rows.num_groups)]
        if pooling_spans:  # a cross-encoder's pair: BERT's segment ids on the metadata (pooling/step.py)
            set_token_type_ids(inputs.metadata, pooling_spans, self.requests, total, self.device)
        staging.end_step()
        return inputs

    def _arrange_rows(self, request_ids: list[str],
                      logits_indices: list[int]) -> tuple[list[str], list[int], BatchUpdate | None]:
        """The sampled requests (and their hidden-state indices) in the processors' row layout, and
        the update that takes the processors there from the previous step's layout."""
        if self.logits_processors is None:  # no processors: the runner keeps no layout
            return request_ids, logits_indices, None
        by_state = {self.requests[rid]: (rid, index) for rid, index in zip(request_ids, logits_indices)}
        batch = self.logits_processors.batch
        update = batch.step(list(by_state), lambda s: (s.sampling, s.prompt_token_ids, s.output_token_ids))
        ordered = [by_state[state] for state in batch.rows]
        return [rid for rid, _ in ordered], [index for _, index in ordered], update


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_request_ids: list[str]
    batch_update: BatchUpdate | None = None  # for the logits processors; None without any, or no change
    # Pooling requests whose prompt ends this step: (request id, first row, end row) in the hidden states.
    pooling_spans: list[tuple[str, int, int]] = field(default_factory=list)
    # Speculative decoding: parallel to sampling_request_ids, each one's drafts; its logits_indices are then
    # its len(drafts) + 1 verified positions. None: no request verifies drafts this step.
    drafts: list[list[int]] | None = None


def _size(num_bytes: int) -> str:
    """Bytes as a reader wants them in a start-up line: GiB from 1 GiB up, MiB below."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
