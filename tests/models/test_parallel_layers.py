"""vLLM's parallel layers, ours (models/layers/linear.py, embedding.py): each rank's weight_loader takes its part
of the checkpoint's whole tensor, and the ranks' parts together compute the whole layer; shard ids, fused
checkpoint tensors, vLLM's forward results, and the errors. Ranks are simulated in one process
(support/tensor_parallel.py); the engine runs them in processes in the TP tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.errors import ModelLoadError
from asyncengine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncengine.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from asyncengine.models.layers.logits import LogitsProcessor
from support.tensor_parallel import as_tensor_parallel_rank

F32 = torch.float32
GEN = torch.Generator().manual_seed(33)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def test_qkv_ranks_take_whole_kv_head_groups_even_when_uneven():
    # SmolLM2's shape in small: 9 query heads, 3 KV heads (groups of 3) over 2 ranks: 2 groups, then 1.
    head, hidden = 4, 8
    q, k, v = randn(9 * head, hidden), randn(3 * head, hidden), randn(3 * head, hidden)
    bias = [randn(9 * head), randn(3 * head), randn(3 * head)]
    x = randn(5, hidden)
    outputs = []
    for rank in range(2):
        with as_tensor_parallel_rank(rank, 2):
            layer = QKVParallelLinear(hidden, head, 9, 3, bias=True, params_dtype=F32, prefix="attn.qkv_proj")
        for shard_id, weight, b in zip("qkv", (q, k, v), bias):
            layer.weight.weight_loader(layer.weight, weight, shard_id)
            layer.bias.weight_loader(layer.bias, b, shard_id)
        assert (layer.num_heads, layer.num_kv_heads) == ((6, 2) if rank == 0 else (3, 1))
        output, output_bias = layer(x)
        assert output_bias is None
        q_size, kv_size = layer.num_heads * head, layer.num_kv_heads * head
        outputs.append(output.split([q_size, kv_size, kv_size], dim=-1))
    reference = [F.linear(x, w, b) for w, b in zip((q, k, v), bias)]
    for index in range(3):  # each projection's columns, rank 0's then rank 1's
        torch.testing.assert_close(torch.cat([outputs[0][index], outputs[1][index]], dim=-1), reference[index])


def test_a_fused_checkpoint_tensor_loads_like_its_shards():
    gate, up = randn(6, 4), randn(6, 4)
    with as_tensor_parallel_rank(1, 2):
        by_shard = MergedColumnParallelLinear(4, [6, 6], bias=False, params_dtype=F32, return_bias=False)
        fused = MergedColumnParallelLinear(4, [6, 6], bias=False, params_dtype=F32, return_bias=False)
    by_shard.weight.weight_loader(by_shard.weight, gate, 0)
    by_shard.weight.weight_loader(by_shard.weight, up, 1)
    fused.weight.weight_loader(fused.weight, torch.cat([gate, up]))  # Phi-3's gate_up_proj: no shard id
    assert torch.equal(fused.weight, by_shard.weight)
    assert torch.equal(fused.weight, torch.cat([gate[3:], up[3:]]))  # rank 1's rows of each


def test_row_parallel_partial_sums_add_up_and_the_bias_is_added_once():
    weight, bias, x = randn(5, 12), randn(5), randn(3, 12)
    partial = []
    for rank in range(2):
        with as_tensor_parallel_rank(rank, 2):
            layer = RowParallelLinear(12, 5, bias=True, params_dtype=F32, reduce_results=False, skip_bias_add=True)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        assert layer.weight.shape == (5, 6) and layer.bias.shape == (5,)
        output, output_bias = layer(x[:, 6 * rank:6 * rank + 6])
        partial.append(output)
    torch.testing.assert_close(sum(partial) + output_bias, F.linear(x, weight, bias))
    # input_is_parallel=False: the whole input, each rank taking its columns
    with as_tensor_parallel_rank(1, 2):
        whole_input = RowParallelLinear(12, 5, bias=False, params_dtype=F32, input_is_parallel=False,
                                        reduce_results=False, return_bias=False)
    whole_input.weight.weight_loader(whole_input.weight, weight)
    torch.testing.assert_close(whole_input(x), partial[1])


def test_column_parallel_replicated_and_vllm_results():
    weight, bias, x = randn(7, 4), randn(7), randn(2, 4)
    column = ColumnParallelLinear(4, 7, bias=True, params_dtype=F32, skip_bias_add=True)
    replicated = ReplicatedLinear(4, 7, bias=True, params_dtype=F32)
    for layer in (column, replicated):
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
    output, output_bias = column(x)  # skip_bias_add: the bias returned, not added
    torch.testing.assert_close(output + output_bias, F.linear(x, weight, bias))
    output, output_bias = replicated(x)
    assert output_bias is None
    torch.testing.assert_close(output, F.linear(x, weight, bias))
    assert (column.weight.output_dim, column.weight.input_dim, column.bias.output_dim) == (0, 1, 0)
    with as_tensor_parallel_rank(1, 2):
        replicated = ReplicatedLinear(4, 7, bias=False, params_dtype=F32)  # every rank holds it whole
    assert replicated.weight.shape == (7, 4)


def test_loading_errors_name_the_parameter_and_the_shapes():
    layer = QKVParallelLinear(8, 4, 2, 1, bias=False, params_dtype=F32, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(4, 8\), but "
                                             r".* expects \(8, 8\)"):
        layer.weight.weight_loader(layer.weight, randn(4, 8), "q")
    with pytest.raises(ModelLoadError, match=r"shard id 0 is none of 'q', 'k', 'v'"):
        layer.weight.weight_loader(layer.weight, randn(8, 8), 0)
    merged = MergedColumnParallelLinear(8, [4, 4], bias=False, params_dtype=F32, prefix="mlp.gate_up_proj")
    with pytest.raises(ModelLoadError, match=r"mlp.gate_up_proj: shard id 2 names none"):
        merged.weight.weight_loader(merged.weight, randn(4, 8), 2)
    with pytest.raises(ModelLoadError, match="gather_output on a layer of several shards"):
        MergedColumnParallelLinear(8, [4, 4], gather_output=True, params_dtype=F32)


def test_vocabulary_ranks_embed_and_score_their_part():
    vocab, hidden = 11, 4
    table = randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10])
    embedded, logits = [], []
    for rank in range(2):
        with as_tensor_parallel_rank(rank, 2):
            embedding = VocabParallelEmbedding(vocab, hidden, params_dtype=F32)
            head = ParallelLMHead(vocab, hidden, params_dtype=F32)
        embedding.weight.weight_loader(embedding.weight, table)
        head.weight.weight_loader(head.weight, table)
        assert embedding.weight.shape == ((6, hidden) if rank == 0 else (5, hidden))  # unpadded, larger part first
        inside = (ids >= embedding.start) & (ids < embedding.end)
        local = F.embedding((ids - embedding.start).clamp(0, embedding.end - embedding.start - 1), embedding.weight)
        embedded.append(local * inside[:, None])
        logits.append(F.linear(table[ids], head.weight))
    torch.testing.assert_close(sum(embedded), table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1), table[ids] @ table.t())
    # one rank: the head computes the logits; vLLM's LogitsProcessor caps, then scales, then trims to org_vocab
    head = ParallelLMHead(vocab, hidden, params_dtype=F32).tie_weights(VocabParallelEmbedding(vocab, hidden,
                                                                                              params_dtype=F32))
    head.weight.data.copy_(table)
    processed = LogitsProcessor(vocab, org_vocab_size=9, scale=0.5, soft_cap=3.0)(head, table[ids])
    torch.testing.assert_close(processed, 0.5 * 3.0 * torch.tanh((table[ids] @ table.t())[:, :9] / 3.0))
