"""FusedMoE: the experts of a mixture-of-experts block, as one custom op (vLLM's `FusedMoE`).

The model computes the router's logits (a plain linear layer) and calls `experts(hidden, router_logits)`;
this layer runs op "fused_moe" (ops/fused_moe.py: routing, the experts' gate-up and down projections, the
weighted sum) through the op providers, adds the shared expert where the architecture has one, and sums the
tensor-parallel ranks' parts.

A plugin may replace the class (`CustomOp.register_oot(name="FusedMoE")`) or add a provider of op
"fused_moe" (`register_op_impl`); `fused_moe_reference` is the `native` provider, a Triton kernel
(ops/triton_moe.py) the `triton` one on CUDA. On CPU, while `native` is the provider that would run, the
grouped CPU kernel (ops/cpu_moe.py) runs instead, on each expert's matrices reordered once for oneDNN.

Parameters, as vLLM names them: `w13_weight` `[E, 2I, H]` (each expert's gate rows above its up rows),
`w2_weight` `[E, H, I]`, and with `has_bias` `w13_bias` `[E, 2I]`, `w2_bias` `[E, H]`. With tensor
parallelism each rank holds the same slice of every expert's intermediate size I (ColumnParallel for gate and
up, RowParallel for down) and the ranks' outputs are summed. With expert parallelism (`enable_expert_parallel`)
each rank holds whole experts instead, a run of them (`E` above is then this rank's count), and the tokens
travel to the ranks that hold their experts (expert_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine import parallel_state as parallel
from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.torch_bases import CustomOp
from asyncengine.models.layers import expert_parallel
from asyncengine.models.layers.linear import check_shape
from asyncengine.models.layers.op_registry import call_op, native_first
from asyncengine.ops import cpu_moe
from asyncengine.ops.fused_moe import MoeConfig

# A checkpoint's name for each projection of an expert -> ours ("w1"/"w3"/"w2" are vLLM's shard ids, and
# Mixtral's checkpoint names).
SHARDS = {"gate": "gate", "w1": "gate", "gate_proj": "gate", "up": "up", "w3": "up", "up_proj": "up",
          "down": "down", "w2": "down", "down_proj": "down"}


@CustomOp.register("FusedMoE")
class FusedMoE(CustomOp):
    """`forward(hidden [M, H], router_logits [M, num_experts]) -> [M, H]`.

    `renormalize`, `routing`, `activation` (and `swiglu_alpha`, `swiglu_limit`) are ops/fused_moe.py's
    MoeConfig fields; `shared_expert` (a module on `[M, H]`) is added to the routed experts' sum, scaled
    by `sigmoid(shared_expert_gate(hidden))` when a gate is given (Qwen2-MoE); the model owns both modules
    (this layer only calls them). `routed_scaling_factor` multiplies the routed sum (DeepSeek).
    """

    shared_expert: nn.Module | None
    shared_expert_gate: nn.Module | None
    expert_tokens: torch.Tensor

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype, renormalize: bool = False, routing: str = "softmax_topk",
                 activation: str = "silu", has_bias: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, routed_scaling_factor: float = 1.0,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # The experts this rank holds, and its rows of each one's intermediate size: every expert's slice with
        # tensor parallelism, whole experts (a run of them) with expert parallelism.
        self.expert_parallel = parallel.expert_parallel()
        if self.expert_parallel:
            self.expert_ranges = expert_parallel.expert_ranges(num_experts, parallel.world_size())
            first, end = self.expert_ranges[parallel.rank()]
            self.first_expert, self.num_local_experts = first, end - first
            self.inner_rows = (0, intermediate_size)
        else:
            self.expert_ranges = [(0, num_experts)]
            self.first_expert, self.num_local_experts = 0, num_experts
            self.inner_rows = parallel.split_evenly(intermediate_size, parallel.world_size())[parallel.rank()]
        self.config = MoeConfig(top_k=top_k, renormalize=renormalize, routing=routing, activation=activation,
                                swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, first_expert=self.first_expert)
        inner = self.inner_rows[1] - self.inner_rows[0]
        experts = self.num_local_experts

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.w13_weight = param(experts, 2 * inner, hidden_size)
        self.w2_weight = param(experts, hidden_size, inner)
        self.w13_bias = param(experts, 2 * inner) if has_bias else None
        self.w2_bias = param(experts, hidden_size) if has_bias else None
        # Called, not owned: the model holds them (their parameters keep the checkpoint's names there), so they
        # are kept out of this module's children.
        object.__setattr__(self, "shared_expert", shared_expert)
        object.__setattr__(self, "shared_expert_gate", shared_expert_gate)
        self.routed_scaling_factor = routed_scaling_factor
        self.reduce_results = reduce_results
        self._cpu_experts: tuple[tuple[Any, ...], cpu_moe.DenseExperts] | None = None
        # Tokens routed to each of the model's experts by this layer (a token counts once per expert it chose),
        # for /metrics; `ExpertLoad` points every layer of a model at one counter.
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    # -- forward -----------------------------------------------------------------------------------------

    def forward_native(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self._finish(hidden, self._route_and_run(hidden, router_logits, self._run_op))

    def forward_cpu(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """`forward_native` through the grouped CPU kernel where nothing else was chosen: not in a subclass
        that overrides `forward_native`, not when a provider other than `native` comes first, not for a
        dtype the kernel lacks."""
        if (type(self).forward_native is FusedMoE.forward_native and native_first("fused_moe")
                and hidden.dtype == self.w13_weight.dtype
                and cpu_moe.supported(hidden, experts := self._dense_experts())):
            if self.expert_parallel:
                return self._finish(hidden, self._route_and_run(hidden, router_logits, self._run_cpu_kernel))
            # The kernel counts the experts it routes to (at decode sizes inside its one C call): no second top-k.
            return self._finish(hidden, cpu_moe.fused_moe_cpu(hidden, router_logits, experts, self.config,
                                                              expert_tokens=self.expert_tokens))
        return self.forward_native(hidden, router_logits)

    def _route_and_run(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                       run: expert_parallel.RunExperts) -> torch.Tensor:
        """The routed experts' weighted sum: this rank's experts run by `run`, where the tokens are (tensor
        parallelism: every rank's part of every expert, summed in `_finish`), or after the tokens travelled to
        the ranks holding their experts and back (expert parallelism)."""
        if self.expert_parallel:
            routed, ids = expert_parallel.dispatch_and_combine(hidden, router_logits, self.config,
                                                               self.expert_ranges, run)
        else:
            routed = run(hidden, router_logits, self.config)
            # The experts the op chose: its top-k of the softmax is the top-k of the logits (the softmax keeps
            # their order), so the cheaper top-k counts the same experts but where rounding ties two.
            ids = torch.topk(router_logits, self.config.top_k, dim=-1).indices
        flat = ids.reshape(-1)
        self.expert_tokens.scatter_add_(0, flat, torch.ones_like(flat))
        return routed

    def _run_op(self, hidden: torch.Tensor, router_logits: torch.Tensor, config: MoeConfig) -> torch.Tensor:
        return call_op("fused_moe", hidden, router_logits, self.w13_weight, self.w2_weight, self.w13_bias,
                       self._w2_bias_here(), config)

    def _run_cpu_kernel(self, hidden: torch.Tensor, router_logits: torch.Tensor, config: MoeConfig) -> torch.Tensor:
        return cpu_moe.fused_moe_cpu(hidden, router_logits, self._dense_experts(), config)

    def _w2_bias_here(self) -> torch.Tensor | None:
        """The down projection's bias where this rank adds it: with tensor parallelism on rank 0 only (the
        ranks' sum adds it once), with expert parallelism on the rank holding the expert."""
        return self.w2_bias if self.expert_parallel or parallel.rank() == 0 else None

    def _finish(self, hidden: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if self.routed_scaling_factor != 1.0:
            routed = routed * self.routed_scaling_factor
        if self.reduce_results and not self.expert_parallel:  # expert parallelism gathered every token's sum
            routed = parallel.all_reduce(routed)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            routed = routed + shared
        return routed

    def _dense_experts(self) -> cpu_moe.DenseExperts:
        """The experts for the CPU kernel, their matrices reordered for oneDNN at the first forward, after the
        weights are loaded, and again when a weight is replaced by another tensor. Like the dense layers'
        reordered weights (cpu_gemm.py), they do not follow a weight written in place after that: call
        `forget_reordered_experts()` then."""
        w2_bias = self._w2_bias_here()
        key = tuple(t.data_ptr() for t in (self.w13_weight, self.w2_weight, self.w13_bias, w2_bias) if t is not None)
        if self._cpu_experts is None or self._cpu_experts[0] != key:
            self._cpu_experts = (key, cpu_moe.DenseExperts.pack(self.w13_weight.data, self.w2_weight.data,
                                                                self.w13_bias, w2_bias))
        return self._cpu_experts[1]

    def forget_reordered_experts(self) -> None:
        self._cpu_experts = None

    # -- loading -----------------------------------------------------------------------------------------

    def load_expert(self, loaded: torch.Tensor, *, expert: int, shard: str, name: str, bias: bool = False) -> None:
        """One expert's checkpoint tensor (per-expert checkpoints, e.g. `mlp.experts.3.gate_proj.weight`):
        `shard` "gate"/"up" ([I, H], or [I] for a bias) or "down" ([H, I], or [H]); vLLM's "w1"/"w3"/"w2"
        and the `*_proj` names are accepted. An expert another rank holds is skipped."""
        if shard not in SHARDS:
            raise ModelLoadError(f"{name!r}: unknown expert projection {shard!r}; expected one of {', '.join(SHARDS)}")
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"{name!r}: expert {expert} of a layer with {self.num_experts} experts")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        part, (start, end) = SHARDS[shard], self.inner_rows
        inner = end - start
        if part == "down":
            if bias:
                self._copy(self._required(self.w2_bias, name)[local], loaded, (self.hidden_size,), name)
            else:
                check_shape(loaded, (self.hidden_size, self.intermediate_size), name)
                self.w2_weight.data[local].copy_(loaded.narrow(1, start, inner))
            return
        offset = 0 if part == "gate" else inner
        if bias:
            check_shape(loaded, (self.intermediate_size,), name)
            self._required(self.w13_bias, name).data[local, offset:offset + inner].copy_(loaded[start:end])
        else:
            check_shape(loaded, (self.intermediate_size, self.hidden_size), name)
            self.w13_weight.data[local, offset:offset + inner].copy_(loaded[start:end])

    def checkpoint_pieces(self, leaf: str) -> set[int]:
        """The pieces of parameter `leaf` a checkpoint must provide, per expert this rank holds: the gate and the
        up part of `w13_*` (2 * local expert, and that + 1), the whole `w2_*` (local expert)."""
        per_expert = 2 if leaf.startswith("w13") else 1
        return set(range(per_expert * self.num_local_experts))

    def load_checkpoint(self, key: str, loaded: torch.Tensor, name: str) -> list[tuple[str, int]]:
        """A checkpoint tensor named `<layer>.experts.<key>`: one expert's projection (`3.gate_proj.weight`,
        Mixtral's `3.w1.weight`, `3.down_proj.bias`) or every expert's stacked (`gate_up_proj`, `down_proj`,
        `gate_up_proj_bias`, `down_proj_bias`; a GGUF file's `gate_proj` and `up_proj` apart). Returns the
        (parameter, piece) pairs it set (`checkpoint_pieces`); none for an expert another rank holds."""
        parts = key.split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] in ("weight", "bias"):
            expert, shard, kind = int(parts[0]), parts[1], parts[2]
            self.load_expert(loaded, expert=expert, shard=shard, name=name, bias=kind == "bias")
            local = expert - self.first_expert
            if not 0 <= local < self.num_local_experts:
                return []
            part = SHARDS[shard]
            if part == "down":
                return [(f"w2_{kind}", local)]
            return [(f"w13_{kind}", 2 * local + (part == "up"))]
        half = {"gate_proj": 0, "up_proj": 1}.get(key.removesuffix(".weight"))
        if half is not None:  # llama.cpp's layout (GGUF ffn_gate_exps, ffn_up_exps): gate and up stacked apart
            self.load_stacked_half(loaded, half=half, name=name)
            return [("w13_weight", 2 * local + half) for local in range(self.num_local_experts)]
        stacked = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "gate_up_proj_bias": "w13_bias",
                   "down_proj_bias": "w2_bias"}
        param = stacked.get(key.removesuffix(".weight"))
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} is not an expert tensor FusedMoE knows: expected "
                                 "experts.<e>.<gate_proj|up_proj|down_proj|w1|w3|w2>.<weight|bias> or experts."
                                 f"<{'|'.join(stacked)}>")
        self.load_stacked(loaded, param=param, name=name)
        return [(param, piece) for piece in self.checkpoint_pieces(param)]

    def load_stacked(self, loaded: torch.Tensor, *, param: str, name: str) -> None:
        """A tensor stacking every expert, in transformers' layout (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
        gate rows first; `down_proj` `[E, H, I]`; their biases `[E, 2I]`, `[E, H]`): `param` is
        "w13_weight", "w2_weight", "w13_bias" or "w2_bias". This rank takes its experts and its slice of I."""
        experts = slice(self.first_expert, self.first_expert + self.num_local_experts)
        full, (start, end) = self.intermediate_size, self.inner_rows
        if param == "w2_weight":
            check_shape(loaded, (self.num_experts, self.hidden_size, full), name)
            self.w2_weight.data.copy_(loaded[experts, :, start:end])
        elif param == "w2_bias":
            self._copy(self._required(self.w2_bias, name), loaded[experts], (self.num_local_experts, self.hidden_size),
                       name)
        elif param in ("w13_weight", "w13_bias"):
            target = self.w13_weight if param == "w13_weight" else self._required(self.w13_bias, name)
            check_shape(loaded, (self.num_experts, 2 * full) + tuple(target.shape[2:]), name)
            mine = loaded[experts]
            target.data.copy_(torch.cat([mine[:, start:end], mine[:, full + start:full + end]], dim=1))
        else:
            raise ModelLoadError(f"{name!r}: FusedMoE has no parameter {param!r} (w13_weight, w2_weight, w13_bias, "
                                 "w2_bias)")

    def load_stacked_half(self, loaded: torch.Tensor, *, half: int, name: str) -> None:
        """Every expert's gate (`half` 0) or up (1) projection stacked, `[E, I, H]`: this rank's experts and
        slice of I, into its half of `w13_weight`."""
        check_shape(loaded, (self.num_experts, self.intermediate_size, self.hidden_size), name)
        (start, end), inner = self.inner_rows, self.inner_rows[1] - self.inner_rows[0]
        mine = loaded[self.first_expert:self.first_expert + self.num_local_experts, start:end]
        self.w13_weight.data[:, half * inner:(half + 1) * inner].copy_(mine)

    def _required(self, param: nn.Parameter | None, name: str) -> nn.Parameter:
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} is an expert bias, but the layer was built without "
                                 "biases (has_bias=False)")
        return param

    @staticmethod
    def _copy(target: torch.Tensor, loaded: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
        check_shape(loaded, shape, name)
        target.data.copy_(loaded)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.config.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, routing={self.config.routing}, "
                f"renormalize={self.config.renormalize}, activation={self.config.activation}"
                + (f", expert_parallel: experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1}"
                   " here" if self.expert_parallel else ""))


class ExpertLoad:
    """Tokens routed per expert, summed over a model's MoE layers: every FusedMoE layer of `model` adds to one
    counter (its first `num_experts` entries), so reading the model's load is one read, not one per layer."""

    def __init__(self, model: nn.Module | None) -> None:
        modules = model.modules() if model is not None else ()
        self.layers = [module for module in modules if isinstance(module, FusedMoE)]
        self.counter: torch.Tensor | None = None
        if self.layers:
            first: torch.Tensor = self.layers[0].expert_tokens
            self.counter = torch.zeros(max(layer.num_experts for layer in self.layers), dtype=torch.int64,
                                       device=first.device)
            for layer in self.layers:
                layer.expert_tokens = self.counter[:layer.num_experts]

    def reset(self) -> None:
        """Back to zero, in place (a captured CUDA graph keeps adding to the same memory)."""
        if self.counter is not None:
            self.counter.zero_()

    def totals(self) -> list[int] | None:
        """Tokens routed to each expert since the model was built (None: the model has no experts)."""
        return None if self.counter is None else [int(count) for count in self.counter.tolist()]
