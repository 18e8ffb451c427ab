"""The mixture-of-experts op: the router's choice, and the torch reference every implementation is held to.

`fused_moe(hidden, router_logits, w13, w2, w13_bias, w2_bias, config)` returns `[M, H]`:

    out[m] = sum over the top-k experts e of token m:  weight[m, e] * down_e(act(gate_up_e(hidden[m])))

- `hidden` `[M, H]`; `router_logits` `[M, E]` over all E experts of the model;
- `w13` `[E_local, 2I, H]`: each expert's gate projection (rows 0..I-1) above its up projection (rows I..2I-1),
  as transformers' MoE modules stack them (`gate_up_proj`); `w2` `[E_local, H, I]` (`down_proj`);
- `w13_bias` `[E_local, 2I]`, `w2_bias` `[E_local, H]`, or None (GPT-OSS has both);
- `config` (`MoeConfig`): top-k, how the router's weights are made, the activation, and which experts this
  process holds (`first_expert`: `w13[0]` is expert `first_expert` of the model; a token whose chosen experts
  are all elsewhere gets zeros here: with experts split over ranks, the ranks' results are summed).

Routing is one function, `select_experts`, that every implementation calls, so they choose the same experts for the
same logits (ties included: torch.topk's order). It works in float32 whatever the model dtype and returns
float32 weights; every implementation applies them in float32 to each expert's output and sums a token's
experts in float32, rounding to the model dtype once.

The implementations: `fused_moe_reference` here (a loop over the experts: gather its tokens, two GEMMs,
scatter back), ops/cpu_moe.py (tokens grouped per expert, each expert's GEMMs once, oneDNN on weights
reordered once; also GGUF-style int8 blocks), ops/triton_moe.py (a grouped GEMM over token blocks sorted by
expert, for CUDA). asyncengine/models/layers/fused_moe.py is the layer that calls them through the op registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# How the router's logits become the top-k experts and their weights:
# "softmax_topk": softmax over all experts (float32), the top-k probabilities, divided by their sum when
#                 `renormalize` (Mixtral always; Qwen2-MoE, Qwen3-MoE and OLMoE when `norm_topk_prob`);
# "topk_softmax": the top-k logits, then a softmax over those k (GPT-OSS). `renormalize` changes nothing there.
ROUTINGS = ("softmax_topk", "topk_softmax")
# "silu": silu(gate) * up (Llama-style experts). "swigluoai": GPT-OSS's clamped variant,
#         (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
ACTIVATIONS = ("silu", "swigluoai")


@dataclass(frozen=True)
class MoeConfig:
    top_k: int
    renormalize: bool = False
    routing: str = "softmax_topk"
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    first_expert: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"MoeConfig.top_k must be a positive int, got {self.top_k!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoeConfig.routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoeConfig.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if isinstance(self.first_expert, bool) or not isinstance(self.first_expert, int) or self.first_expert < 0:
            raise ValueError(f"MoeConfig.first_expert must be an int >= 0, got {self.first_expert!r}")


def select_experts(router_logits: torch.Tensor, config: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 `[M, k]`, expert ids int64 `[M, k]`, ids over all the model's experts)."""
    logits = router_logits.float()
    if config.routing == "topk_softmax":
        top, ids = torch.topk(logits, config.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), config.top_k, dim=-1)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def activate(gate_up: torch.Tensor, config: MoeConfig) -> torch.Tensor:
    """`[..., 2I]` (gate, then up) -> `[..., I]`, in the input's dtype, rounding where torch's ops round."""
    gate, up = gate_up.chunk(2, dim=-1)
    if config.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=config.swiglu_limit)
    up = up.clamp(min=-config.swiglu_limit, max=config.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * config.swiglu_alpha))


def check_arguments(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, config: MoeConfig) -> None:
    """A ValueError naming the first argument whose shape does not fit the others."""
    if not isinstance(config, MoeConfig):
        raise ValueError(f"fused_moe takes a MoeConfig, got {type(config).__name__}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes hidden [M, H], w13 [E, 2I, H] and w2 [E, H, I]; got hidden "
                         f"{tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    tokens, size = hidden.shape
    experts, double, inner = w13.shape[0], w13.shape[1], w2.shape[2]
    if w13.shape[2] != size or double != 2 * inner or tuple(w2.shape[:2]) != (experts, size):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and "
                         f"[E, H, I] for H={size} (hidden {tuple(hidden.shape)})")
    if router_logits.dim() != 2 or router_logits.shape[0] != tokens:
        raise ValueError(f"fused_moe: router_logits {tuple(router_logits.shape)} is not [M, E] for M={tokens}")
    if config.first_expert + experts > router_logits.shape[1]:
        raise ValueError(f"fused_moe: experts {config.first_expert}..{config.first_expert + experts - 1} held here, "
                         f"but the router scores only {router_logits.shape[1]}")
    if config.top_k > router_logits.shape[1]:
        raise ValueError(f"fused_moe: top_k {config.top_k} is more than the router's {router_logits.shape[1]} experts")
    for name, bias, shape in (("w13_bias", w13_bias, (experts, double)), ("w2_bias", w2_bias, (experts, size))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"fused_moe: {name} {tuple(bias.shape)} is not {shape}")


def fused_moe_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                        config: MoeConfig) -> torch.Tensor:
    """The plain loop: per expert, gather its tokens, two GEMMs (and the activation between), scatter back."""
    check_arguments(hidden, router_logits, w13, w2, w13_bias, w2_bias, config)
    weights, ids = select_experts(router_logits, config)
    local = ids - config.first_expert
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(local == expert)
        if token.numel() == 0:
            continue
        gate_up = F.linear(hidden[token], w13[expert], None if w13_bias is None else w13_bias[expert])
        y = F.linear(activate(gate_up, config), w2[expert], None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(hidden.dtype)
