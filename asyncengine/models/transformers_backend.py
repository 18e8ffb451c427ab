"""The transformers backend (vLLM's `--model-impl transformers`): any decoder transformers implements, run over our
paged KV cache and scheduler.

transformers' own modelling code computes everything but attention: each of its attention modules calls the
function `config._attn_implementation` names in transformers' AttentionInterface, and we register one
(`paged_attention_forward`, under ATTENTION_NAME) that hands the step's queries, keys and values to one of our
PagedAttention layers, which stores the keys and values in the paged cache and attends over each sequence's pages.
The batch reaches transformers as it reaches our models: one row of every token of the step (batch size 1), with
each token's own position as `position_ids` (rotary is transformers'), no attention mask (a causal mask of the
packed row would be wrong; the paged attention knows each sequence's extent from the step's metadata) and no
transformers cache. So the runner, the scheduler, prefix caching, chunked prefill and preemption see a model like
any other.

What this costs against a native class: transformers' unfused projections and its per-layer Python, the transposes
into and out of its [batch, heads, tokens, head_dim] layout, and no tensor or pipeline parallelism (one rank).
The logits are the output embedding's, with the post-processing transformers' causal LMs apply after it that this
module knows (Cohere's logit_scale, Granite's logits_scaling, Gemma's final_logit_softcapping); a remote model
that does something else there is not covered (docs/models.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncengine.config.model import ModelConfig, auto_map_of
from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.attention import AttentionMetadata, PagedAttention
from asyncengine.models.layers.logits import finish_logits, some_names
from asyncengine import parallel_state as parallel

# The name our attention function is registered under in transformers' AttentionInterface (never in its mask
# interface: transformers then builds no attention mask for it).
ATTENTION_NAME = "asyncengine_paged"

# Checkpoint tensors that transformers recomputes and no model here loads.
IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)


class StepContext:
    """The step's attention metadata while the model runs (one per model: a worker runs one step at a time)."""

    def __init__(self) -> None:
        self.metadata: AttentionMetadata | None = None


class TransformersAttention(PagedAttention):
    """The PagedAttention an attention module of transformers' model hands its queries to (attached to that module
    as `asyncengine_attention`), with the step's metadata from the model's StepContext."""

    def __init__(self, step: StepContext, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None, logits_soft_cap: float | None, layer_index: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap, layer_index=layer_index)
        self.step = step


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: `query` `[1, heads, tokens, head_dim]`, `key`/`value`
    `[1, kv_heads, tokens, head_dim]` (the whole step's tokens as one row); returns `[1, tokens, heads, head_dim]`
    and no attention weights. What the module passes that the layer was not built with is an error, not ignored."""
    layer = getattr(module, "asyncengine_attention", None)
    if not isinstance(layer, TransformersAttention):
        raise RuntimeError(f"{type(module).__name__} called the {ATTENTION_NAME} attention function but was not "
                           "prepared by TransformersForCausalLM (no asyncengine_attention layer attached)")
    metadata = layer.step.metadata
    if metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran outside TransformersForCausalLM.forward (no step metadata)")
    _check_call(layer, query, key, scaling, kwargs)
    cache_dtype = layer.kv_cache[0].dtype if layer.kv_cache is not None else query.dtype
    # [1, heads, tokens, head_dim] -> [tokens, heads, head_dim], contiguous as the kernels want (a no-op for most
    # models, whose [1, heads, tokens, head_dim] is itself a transposed view of [1, tokens, heads, head_dim]).
    out = layer(query[0].transpose(0, 1).to(cache_dtype).contiguous(),
                key[0].transpose(0, 1).to(cache_dtype).contiguous(),
                value[0].transpose(0, 1).to(cache_dtype).contiguous(), metadata)
    return out.view(1, out.shape[0], layer.num_heads, layer.head_dim).to(query.dtype), None


def _check_call(layer: TransformersAttention, query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                kwargs: dict[str, Any]) -> None:
    if query.shape[0] != 1 or query.shape[1] != layer.num_heads or key.shape[1] != layer.num_kv_heads \
            or query.shape[-1] != layer.head_dim:
        raise ModelLoadError(f"attention layer {layer.layer_index} got queries {tuple(query.shape)} and keys "
                             f"{tuple(key.shape)}, not the [1, {layer.num_heads} / {layer.num_kv_heads} heads, tokens, "
                             f"{layer.head_dim}] its config gives: this model's attention is not supported by the "
                             "transformers backend")
    if scaling is not None and not math.isclose(float(scaling), layer.scale, rel_tol=1e-6):
        raise ModelLoadError(f"attention layer {layer.layer_index} was called with scaling {scaling}, built with "
                             f"{layer.scale}")
    window, cap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if (int(window) if window else None) != layer.sliding_window:  # both ways: a window must never be dropped
        raise ModelLoadError(f"attention layer {layer.layer_index} was called with sliding window {window}, built "
                             f"with {layer.sliding_window}")
    if cap is not None and cap != layer.logits_soft_cap:
        raise ModelLoadError(f"attention layer {layer.layer_index} was called with soft cap {cap}, built with "
                             f"{layer.logits_soft_cap}")


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


_register()


@dataclass(frozen=True)
class TransformersModelSpec:
    """What TransformersForCausalLM is built from (`TransformersForCausalLM.spec_of`): transformers' config object,
    and where the model's own modelling code is when trust_remote_code lets it run (None: transformers' class)."""

    config: Any
    remote_code_dir: str | None = None


class TransformersForCausalLM(nn.Module):
    """transformers' causal LM for a TransformersModelSpec, its attention over our paged KV cache. Holds
    transformers' model as `hf`; checkpoint names are transformers' own."""

    supports_cuda_graphs = False  # transformers' Python per layer is not checked for capture (model_runner.py)

    def __init__(self, spec: TransformersModelSpec, *, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        if parallel.world_size() > 1 or parallel.pipeline_size() > 1:
            raise ModelLoadError("the transformers backend runs on one rank: tensor_parallel_size and "
                                 "pipeline_parallel_size must be 1")
        self.config = config = spec.config
        model_cls = _causal_lm_class(spec)
        if not getattr(model_cls, "_supports_attention_backend", False):
            raise ModelLoadError(f"{model_cls.__name__} does not call transformers' attention interface "
                                 "(_supports_attention_backend is false), so its attention cannot read our paged KV "
                                 "cache: this architecture cannot run through the transformers backend")
        self.hf = model_cls._from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
        self.hf.eval()
        if self.hf.base_model is self.hf:  # forward() runs the decoder without the head: it must be reachable
            raise ModelLoadError(f"{model_cls.__name__} names no decoder submodule (its base_model_prefix "
                                 f"{getattr(model_cls, 'base_model_prefix', '')!r} is not an attribute of it): the "
                                 "transformers backend needs the hidden states before the LM head")
        self.step = StepContext()
        self.num_attention_layers = self._attach_attention(config)
        self.logit_scale = getattr(self.hf, "logit_scale", None)  # Cohere multiplies the logits by it
        self.logits_divisor = getattr(config, "logits_scaling", None)  # Granite divides by it
        self.final_logit_soft_cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3

    @classmethod
    def spec_of(cls, model_config: ModelConfig) -> TransformersModelSpec:
        """What to build the model from: transformers' config object (its config class, the model files' own with
        trust_remote_code and an auto_map, over the resolved config.json with hf_overrides applied), and where
        the files' own modelling code is when trust_remote_code lets it run."""
        import transformers
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        data = dict(model_config.hf_config)
        auto_map = auto_map_of(data)
        if model_config.trust_remote_code and "AutoConfig" in auto_map:
            config_cls = get_class_from_dynamic_module(auto_map["AutoConfig"], model_config.model_dir)
        elif data.get("model_type") in transformers.CONFIG_MAPPING:
            config_cls = transformers.CONFIG_MAPPING[data["model_type"]]
        else:
            raise ModelLoadError(f"transformers has no configuration class for model_type {data.get('model_type')!r} "
                                 f"of {model_config.model_dir}")
        remote = model_config.trust_remote_code and "AutoModelForCausalLM" in auto_map
        return TransformersModelSpec(config_cls.from_dict(data), model_config.model_dir if remote else None)

    def _attach_attention(self, config: Any) -> int:
        """One TransformersAttention per attention module of transformers' model (modules named *Attention with a
        `layer_idx`), built from the module's own head size, scale, window and soft cap."""
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        count = 0
        for module in self.hf.modules():
            layer_index = getattr(module, "layer_idx", None)
            if not type(module).__name__.endswith("Attention") or not isinstance(layer_index, int):
                continue
            head_dim = int(getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
                           or config.hidden_size // num_heads)
            # The module's own (Qwen2, Gemma 2/3: per layer type), else the config's (Mistral and Phi-3 pass
            # config.sliding_window on every layer); a call that disagrees is an error (_check_call).
            window = module.sliding_window if hasattr(module, "sliding_window") \
                else getattr(config, "sliding_window", None)
            cap = getattr(module, "attn_logit_softcapping", None)
            module.asyncengine_attention = TransformersAttention(
                self.step, num_heads, num_kv_heads, head_dim, float(getattr(module, "scaling", head_dim**-0.5)),
                sliding_window=int(window) if window else None, logits_soft_cap=float(cap) if cap else None,
                layer_index=layer_index)
            count += 1
        expected = int(config.num_hidden_layers)
        if count != expected:
            raise ModelLoadError(f"found {count} attention modules (named *Attention, with a layer_idx) in "
                                 f"{type(self.hf).__name__} for its {expected} layers: the transformers backend "
                                 "cannot map this model's attention onto the paged KV cache")
        return count

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states, one row per input token."""
        self.step.metadata = metadata
        try:
            output = self.hf.base_model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                        use_cache=False)
        finally:
            self.step.metadata = None
        return output[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return finish_logits(self.hf.get_output_embeddings()(hidden), multiplier=self.logit_scale,
                             divisor=self.logits_divisor, cap=self.final_logit_soft_cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers' names, as save_pretrained writes them) into transformers' model;
        every parameter must be set (a tied one by either of its names)."""
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        buffers = dict(self.hf.named_buffers())
        required = {id(param): name for name, param in self.hf.named_parameters()}
        loaded: set[int] = set()
        unexpected = []
        with torch.no_grad():
            for name, tensor in weights:
                target = params.get(name)
                if target is None:
                    target = buffers.get(name)
                if target is None:
                    if not name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                        unexpected.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model "
                                         f"expects {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(id(target))
        if unexpected:
            raise ModelLoadError(f"the checkpoint has tensors transformers' {type(self.hf).__name__} does not have: "
                                 f"{some_names(unexpected)} (a checkpoint transformers renames on load is not supported "
                                 "by the transformers backend)")
        missing = [name for key, name in required.items() if key not in loaded]
        if missing:
            raise ModelLoadError(f"the checkpoint lacks weights for: {some_names(missing)}")


def _causal_lm_class(spec: TransformersModelSpec) -> Any:
    """The model files' own class (trust_remote_code, auto_map), else transformers' class of the architecture."""
    import transformers
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = spec.config
    if spec.remote_code_dir is not None:
        return get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], spec.remote_code_dir)
    for name in getattr(config, "architectures", None) or []:
        model_cls = getattr(transformers, name, None)
        if name.endswith("ForCausalLM") and isinstance(model_cls, type):
            return model_cls
    raise ModelLoadError(f"transformers has no causal language model class for {config.architectures}")
