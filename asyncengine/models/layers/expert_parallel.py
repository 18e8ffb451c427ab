"""Expert parallelism (`enable_expert_parallel`, vLLM's `--enable-expert-parallel`): a MoE layer's experts split
over the tensor-parallel ranks, each rank holding whole experts, instead of every rank holding a slice of every
expert's matrices.

With tensor parallelism every rank holds the same tokens (the attention's output is summed over the ranks). A
MoE layer then, on every rank:

1. routes every token (`select_experts` on the same logits: every rank makes the same choice, the one the
   tensor-parallel layer and a single rank make), and keeps its share of the tokens (`split_evenly`: rank r
   takes the r-th run of tokens; with fewer tokens than ranks some take none);
2. sends each (token, slot) pair of its share to the rank that holds the pair's expert (`all_to_all_rows`,
   after `exchange_counts` told each rank how many rows it receives);
3. runs its experts on the rows it received (`run_experts(rows, logits, config)`: the layer's own
   implementation, fed router logits that choose each row's expert with weight 1, so that any provider of op
   "fused_moe" serves, unchanged);
4. sends each result back to the rank the pair came from (the reverse all-to-all), which sums each token's k
   results times their router weights in float32 and rounds once to the model dtype, as every
   implementation of the op does;
5. gathers the ranks' shares of tokens (`all_gather_rows`), so every rank again holds every token.

Over gloo on CPU and NCCL on CUDA alike: the collectives are asyncengine.parallel_state's, on the stage's
tensor-parallel group. Each rank's expert work is the pairs routed to its experts, as with the dense
all-reduce alternative; what travels is k rows per token there and back, then one row per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from asyncengine import parallel_state as parallel
from asyncengine.errors import ModelLoadError
from asyncengine.ops.fused_moe import MoeConfig, select_experts

# (rows [n, H], router logits [n, E], config) -> the experts' weighted sum [n, H], in the rows' dtype.
RunExperts = Callable[[torch.Tensor, torch.Tensor, MoeConfig], torch.Tensor]


def expert_ranges(num_experts: int, ranks: int) -> list[tuple[int, int]]:
    """[first, end) of the experts each rank holds: split as evenly as possible, the earlier ranks one more
    where the count does not divide (vLLM's placement). Every rank needs at least one expert."""
    if num_experts < ranks:
        raise ModelLoadError(f"expert parallelism splits the {num_experts} experts of each MoE layer over "
                             f"{ranks} tensor-parallel ranks, and each rank needs at least one: lower "
                             "tensor_parallel_size or drop enable_expert_parallel")
    return parallel.split_evenly(num_experts, ranks)


def chosen_expert_logits(expert_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Router logits `[n, E]` under which top-1 "topk_softmax" routing (`single_expert_config`) picks
    `expert_ids[i]` for row i with weight exactly 1: 0 there, -inf elsewhere."""
    logits = torch.full((expert_ids.shape[0], num_experts), float("-inf"), dtype=dtype, device=expert_ids.device)
    return logits.scatter_(1, expert_ids.view(-1, 1), 0.0)


def single_expert_config(config: MoeConfig) -> MoeConfig:
    """`config` with its activation kept and routing reduced to the one expert `chosen_expert_logits` names."""
    return dataclasses.replace(config, top_k=1, routing="topk_softmax", renormalize=False)


def dispatch_and_combine(hidden: torch.Tensor, router_logits: torch.Tensor, config: MoeConfig,
                         ranges: list[tuple[int, int]], run_experts: RunExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' weighted sum `[M, H]` of every token, the same on every rank, and the expert ids
    chosen `[M, k]` (for the layer's load counts). `ranges`: each rank's [first, end) experts; `config`'s
    `first_expert` is this rank's."""
    ranks, me = parallel.world_size(), parallel.rank()
    num_experts = router_logits.shape[1]
    weights, ids = select_experts(router_logits, config)
    shares = [end - start for start, end in parallel.split_evenly(hidden.shape[0], ranks)]
    start = sum(shares[:me])
    mine, my_weights = ids[start:start + shares[me]], weights[start:start + shares[me]]
    k = ids.shape[1]
    pair_experts = mine.reshape(-1)
    ends = torch.tensor([end for _, end in ranges], dtype=pair_experts.dtype, device=pair_experts.device)
    destination = torch.bucketize(pair_experts, ends, right=True)  # the rank holding each pair's expert
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination, minlength=ranks).tolist()
    receive_counts = parallel.exchange_counts(send_counts, hidden.device)
    rows = parallel.all_to_all_rows(hidden[start:start + shares[me]].index_select(0, order // k), send_counts,
                                    receive_counts)
    row_experts = parallel.all_to_all_rows(pair_experts[order], send_counts, receive_counts)
    if rows.shape[0]:
        local = run_experts(rows, chosen_expert_logits(row_experts, num_experts, router_logits.dtype),
                            single_expert_config(config))
    else:
        local = rows
    returned = parallel.all_to_all_rows(local, receive_counts, send_counts)  # in `order`
    results = torch.empty_like(returned)
    results[order] = returned
    summed = (results.view(-1, k, hidden.shape[1]).float() * my_weights.unsqueeze(-1)).sum(dim=1)
    return parallel.all_gather_rows(summed.to(hidden.dtype), shares), ids
