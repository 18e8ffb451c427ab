"""vLLM's linear layers, ours: `ReplicatedLinear`, `ColumnParallelLinear`, `MergedColumnParallelLinear`,
`QKVParallelLinear`, `RowParallelLinear`, with vLLM's constructors, forward results and weight loaders, so that a
vLLM model file and ours read alike (docs/porting.md, layers).

A column-parallel layer splits its output features over the tensor-parallel ranks: rank r computes its rows of
each shard (q, k and v fused into one matrix, or gate and up), so no communication is needed. A row-parallel
layer splits its input features: each rank multiplies its slice and the partial results are summed across ranks
(its bias added once, after the sum). With one rank both are plain linear layers.

Loading is vLLM's protocol, whose helpers live here too (`set_weight_attrs`, `default_weight_loader`): each
parameter carries `weight_loader(param, loaded_weight[, loaded_shard_id])`, given the checkpoint's whole tensor,
which takes this rank's part, and the linear layers' weights `output_dim`/`input_dim` (the dimension the
tensor-parallel split cuts); a model's `load_weights` calls `getattr(param, "weight_loader",
default_weight_loader)(param, tensor[, shard_id])` for each checkpoint tensor (docs/porting.md, layers); shard ids are "q"/"k"/"v" for QKVParallelLinear and 0, 1, ... for MergedColumnParallelLinear, and
no shard id on a fused layer means the checkpoint stores it fused (Phi-3's qkv_proj): it is split here.

Where vLLM requires a split to divide evenly, these layers split as evenly as possible instead (larger parts
first): QKVParallelLinear gives each rank whole KV-head groups (`partition_heads`), so SmolLM2's 3 KV heads run on
2 ranks, and the RowParallelLinear after it takes the same columns (`input_partition`).

Each layer's weight is created, loaded and applied by its `quant_method` (models/layers/quantization.py):
plain float unless the model is built with a quantization method (`quantization="int8"`, vLLM's
`quant_config=`, or a plugin's method, ours or vLLM's LinearMethodBase).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine import parallel_state as parallel
from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.quantization import LinearBase
from asyncengine.models.layers.quantization import linear_method_for

Range = tuple[int, int]


# -- vLLM's weight-loading helpers ------------------------------------------------------------------------


def set_weight_attrs(weight: Any, weight_attrs: dict[str, Any] | None) -> None:
    """vLLM's: set attributes on a parameter (its `weight_loader`, `output_dim`, ...); refusing to overwrite
    one already set, as vLLM's does (with an error here, not an assert)."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        if hasattr(weight, key):
            raise AttributeError(f"set_weight_attrs: the parameter already has {key!r}; vLLM refuses to overwrite "
                                 "it, and so does asyncengine")
        setattr(weight, key, value)


def check_shape(loaded: Any, expected: tuple[int, ...], name: str) -> None:
    """The whole checkpoint tensor must have the shape config.json implies (before any rank takes its part)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, but the model built from "
            f"config.json expects {tuple(expected)}: the weights do not match the config"
        )


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy with a clear error when the checkpoint's tensor has the wrong shape."""
    check_shape(loaded, tuple(target.shape), name)
    target.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """vLLM's: the whole tensor into a parameter no rank splits (norms, a replicated layer's weight); a
    one-element tensor fills a one-element parameter whatever their shapes (a scale stored as a scalar)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    copy_checked(param.data, loaded_weight, getattr(param, "checkpoint_name", "weight"))


# -- the layers -------------------------------------------------------------------------------------------



def partition_heads(num_heads: int, num_kv_heads: int, *, ranks: int | None = None,
                    rank: int | None = None) -> tuple[Range, Range]:
    """This rank's [start, end) of query heads and of KV heads.

    Ranks take whole groups (a KV head with the query heads that share it), as evenly as possible, so
    an uneven count (SmolLM2's 3 KV heads on 2 ranks) still works. With fewer KV heads than ranks,
    each KV head is repeated on `ranks / kv_heads` ranks, which split its query heads.
    """
    ranks = parallel.world_size() if ranks is None else ranks
    rank = parallel.rank() if rank is None else rank
    group = num_heads // num_kv_heads
    if num_kv_heads >= ranks:
        kv_start, kv_end = parallel.split_evenly(num_kv_heads, ranks)[rank]
        return (kv_start * group, kv_end * group), (kv_start, kv_end)
    if ranks % num_kv_heads or group % (ranks // num_kv_heads):
        raise ModelLoadError(
            f"{num_heads} attention heads with {num_kv_heads} KV heads cannot be split over "
            f"tensor_parallel_size={ranks}: with fewer KV heads than ranks, the ranks must divide evenly "
            "among the KV heads and their query heads"
        )
    replicas = ranks // num_kv_heads
    kv_head = rank // replicas
    q_start, q_end = parallel.split_evenly(group, replicas)[rank % replicas]
    return (kv_head * group + q_start, kv_head * group + q_end), (kv_head, kv_head + 1)


class LinearLayer(nn.Module):
    """What the five layers share (vLLM's LinearBase): the sizes, the rank, the quantization method, and the
    forward result, `(output, output_bias)` (the bias returned instead of added when `skip_bias_add`), or the
    output alone with `return_bias=False`."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, input_size: int, output_size: int, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.quant_config = quant_config
        self.prefix = prefix
        self.return_bias = return_bias
        self.disable_tp = disable_tp
        self.tp_rank = 0 if disable_tp else parallel.rank()
        self.tp_size = 1 if disable_tp else parallel.world_size()

    def _create_weights(self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool) -> None:
        """The method's weights, then the bias; every parameter gets this layer's weight_loader unless the
        method set its own (vLLM's methods pass it on through `set_weight_attrs`)."""
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method = linear_method_for(self, self.prefix, self.quant_config)
        self.quant_method.create_weights(self, input_size_per_partition, self.output_size_per_partition,
                                         self.params_dtype)
        for name, param in self.named_parameters(recurse=False):
            if name == "weight":
                for attribute, dim in (("output_dim", 0), ("input_dim", 1)):
                    if not hasattr(param, attribute):
                        setattr(param, attribute, dim)
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        raise NotImplementedError

    def layer_result(self, output: torch.Tensor) -> Any:
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)

    def _param_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the model, for errors (vLLM's weight_loader is not given it)."""
        leaf = next((name for name, own in self.named_parameters(recurse=False) if own is param), "parameter")
        return f"{self.prefix}.{leaf}" if self.prefix else f"{type(self).__name__}.{leaf}"

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, output_features={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class _OutputShardedLinear(LinearLayer):
    """A layer whose output stacks shards (one, or q/k/v, or gate/up): shard i is rows `shard_ranges[i]` of a
    checkpoint tensor with `output_sizes[i]` rows; this rank's rows of each, stacked, are its weight."""

    output_sizes: list[int]  # each shard's rows in the checkpoint (vLLM's name)
    shard_ranges: list[Range]  # this rank's [start, end) of each shard's rows

    def _shard_index(self, loaded_shard_id: Any) -> int:
        if isinstance(loaded_shard_id, int) and not isinstance(loaded_shard_id, bool) \
                and 0 <= loaded_shard_id < len(self.output_sizes):
            return loaded_shard_id
        raise ModelLoadError(f"{self.prefix or type(self).__name__}: shard id {loaded_shard_id!r} names none of "
                             f"this {type(self).__name__}'s {len(self.output_sizes)} shards (0 to "
                             f"{len(self.output_sizes) - 1})")

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def shard_ids(self) -> list[Any]:
        """The shard ids its weight_loader takes, in output order."""
        return list(range(self.num_shards))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        if loaded_shard_id is None and self.num_shards > 1:
            # The checkpoint stores the shards fused (Phi-3's qkv_proj, GLM-4's gate_up_proj): each part to its shard.
            output_dim = getattr(param, "output_dim", 0)
            whole = (sum(self.output_sizes),) + tuple(loaded_weight.shape[1:])
            check_shape(loaded_weight, whole if output_dim == 0 else tuple(loaded_weight.shape), self._param_name(param))
            for index, part in enumerate(loaded_weight.split(self.output_sizes, dim=output_dim or 0)):
                self._load_shard(param, part, index)
            return
        self._load_shard(param, loaded_weight, 0 if loaded_shard_id is None else self._shard_index(loaded_shard_id))

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, index: int) -> None:
        start, end = self.shard_ranges[index]
        offset = sum(self.output_partition_sizes[:index])
        name = self._param_name(param)
        if param is self.weight:  # through the method, which may quantize the float rows as they arrive
            check_shape(loaded, (self.output_sizes[index], self.input_size), name)
            self.quant_method.load_weight_rows(self, offset, loaded.narrow(0, start, end - start))
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # a parameter no rank splits (a per-tensor scale)
            copy_checked(param.data, loaded, name)
            return
        if loaded.shape[output_dim] != self.output_sizes[index]:
            raise ModelLoadError(f"checkpoint tensor {name!r} (shard {index}) has shape {tuple(loaded.shape)}, but "
                                 f"the model built from config.json expects {self.output_sizes[index]} along dimension "
                                 f"{output_dim}: the weights do not match the config")
        copy_checked(param.data.narrow(output_dim, offset, end - start),
                     loaded.narrow(output_dim, start, end - start), name)


class ReplicatedLinear(_OutputShardedLinear):
    """`y = x W^T (+ b)`, the whole layer on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=True)
        self.output_sizes = [output_size]
        self.shard_ranges = [(0, output_size)]
        self._create_weights(input_size, [output_size], bias)

    def forward(self, x: torch.Tensor) -> Any:
        bias = None if self.skip_bias_add else self.bias
        return self.layer_result(self.quant_method.apply(self, x, bias))


class ColumnParallelLinear(_OutputShardedLinear):
    """`y = x W^T (+ b)` with W's rows split over the ranks; `gather_output` concatenates the ranks' outputs."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 output_sizes: list[int] | None = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=disable_tp)
        if output_sizes is None:
            output_sizes = [output_size]
        if sum(output_sizes) != output_size:
            raise ModelLoadError(f"{prefix or type(self).__name__}: output_sizes {output_sizes} do not add up to "
                                 f"output_size {output_size}")
        self.gather_output = gather_output
        if gather_output and len(output_sizes) > 1:
            raise ModelLoadError(f"{prefix or type(self).__name__}: gather_output on a layer of several shards would "
                                 "interleave the ranks' parts of each shard; gather a single-shard layer instead")
        self.output_sizes = list(output_sizes)
        self.shard_ranges = self.partition()
        self._create_weights(input_size, [end - start for start, end in self.shard_ranges], bias)

    def partition(self, rank: int | None = None) -> list[Range]:
        """Rank `rank`'s (this one's) [start, end) of each shard's rows: split as evenly as possible."""
        rank = self.tp_rank if rank is None else rank
        return [parallel.split_evenly(size, self.tp_size)[rank] for size in self.output_sizes]

    def forward(self, x: torch.Tensor) -> Any:
        bias = None if self.skip_bias_add else self.bias
        output = self.quant_method.apply(self, x, bias)
        if self.gather_output and self.tp_size > 1:
            sizes = [sum(end - start for start, end in self.partition(rank)) for rank in range(self.tp_size)]
            output = parallel.all_gather_last_dim(output, sizes)
        return self.layer_result(output)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input as one matrix (gate and up): shard i is checkpoint tensor i,
    `output_sizes[i]` rows, loaded with shard id i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add, params_dtype,
                         quant_config, list(output_sizes), prefix, return_bias=return_bias, disable_tp=disable_tp)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one matrix, split over the ranks by whole KV-head groups
    (`partition_heads`); loaded with shard ids "q", "k", "v" (or fused, with none). vLLM's attributes:
    `num_heads`, `num_kv_heads` (this rank's), `total_num_heads`, `total_num_kv_heads`, `head_size`,
    `num_kv_head_replicas`; ours: `q_range`, `kv_range`, this rank's rows of the q and of the k/v projections
    (the RowParallelLinear after attention takes `q_range` as its `input_partition`)."""

    SHARD_IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False,
                 v_head_size: int | None = None) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        sizes = [total_num_heads * head_size, self.total_num_kv_heads * head_size,
                 self.total_num_kv_heads * self.v_head_size]
        super().__init__(hidden_size, sum(sizes), bias, False, skip_bias_add, params_dtype, quant_config, sizes,
                         prefix, return_bias=return_bias, disable_tp=disable_tp)
        (q_start, q_end), (kv_start, kv_end) = self.head_partition()
        self.num_heads, self.num_kv_heads = q_end - q_start, kv_end - kv_start
        self.num_kv_head_replicas = max(1, self.tp_size // self.total_num_kv_heads)
        self.q_range, self.kv_range = self.shard_ranges[0], self.shard_ranges[1]

    def head_partition(self, rank: int | None = None) -> tuple[Range, Range]:
        return partition_heads(self.total_num_heads, self.total_num_kv_heads, ranks=self.tp_size,
                               rank=self.tp_rank if rank is None else rank)

    def partition(self, rank: int | None = None) -> list[Range]:
        (q_start, q_end), (kv_start, kv_end) = self.head_partition(rank)
        return [(q_start * self.head_size, q_end * self.head_size), (kv_start * self.head_size, kv_end * self.head_size),
                (kv_start * self.v_head_size, kv_end * self.v_head_size)]

    def shard_ids(self) -> list[Any]:
        return list(self.SHARD_IDS)

    def _shard_index(self, loaded_shard_id: Any) -> int:
        if loaded_shard_id in self.SHARD_IDS:
            return self.SHARD_IDS[loaded_shard_id]
        raise ModelLoadError(f"{self.prefix or 'QKVParallelLinear'}: shard id {loaded_shard_id!r} is none of "
                             "'q', 'k', 'v' (vLLM's QKVParallelLinear shard ids)")


class RowParallelLinear(LinearLayer):
    """`y = sum over ranks of x_r W_r^T (+ b)`: this rank holds input features `input_partition` (default: an even
    split; the attention output's rows as QKVParallelLinear split them, for o_proj). `input_is_parallel=False`:
    the whole input is given and each rank takes its part; `reduce_results=False`: the partial sums are returned
    unsummed (the bias then left to the caller, as vLLM does)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False,
                 input_partition: Range | None = None) -> None:
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix,
                         return_bias=return_bias, disable_tp=disable_tp)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        if bias and not reduce_results and not skip_bias_add and self.tp_size > 1:
            raise ModelLoadError(f"{prefix or 'RowParallelLinear'}: a bias with reduce_results=False would be added "
                                 "on every rank before the caller's sum; pass skip_bias_add=True and add it after")
        start, end = input_partition or parallel.split_evenly(input_size, self.tp_size)[self.tp_rank]
        self.input_range = (start, end)
        self._create_weights(end - start, [output_size], bias)

    def forward(self, x: torch.Tensor) -> Any:
        if not self.input_is_parallel:
            start, end = self.input_range
            x = x[..., start:end]
        output = self.quant_method.apply(self, x)
        return self.layer_result(self.finish(output))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial product summed over the ranks, then the bias (once, after the sum)."""
        output = parallel.all_reduce(partial) if self.reduce_results and self.tp_size > 1 else partial
        return output + self.bias if self.bias is not None and not self.skip_bias_add else output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        start, end = self.input_range
        name = self._param_name(param)
        if param is self.weight:  # through the method, which may quantize the float rows as they arrive
            check_shape(loaded_weight, (self.output_size, self.input_size), name)
            self.quant_method.load_weight_rows(self, 0, loaded_weight.narrow(1, start, end - start))
            return
        input_dim = getattr(param, "input_dim", None)
        if input_dim is None:  # the bias, or a parameter no rank splits
            copy_checked(param.data, loaded_weight, name)
            return
        if loaded_weight.shape[input_dim] != self.input_size:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(loaded_weight.shape)}, but the model "
                                 f"built from config.json expects {self.input_size} along dimension {input_dim}")
        copy_checked(param.data, loaded_weight.narrow(input_dim, start, end - start), name)


# vLLM's methods ask `isinstance(layer, LinearBase)` to choose which layers they quantize.
LinearBase.register(LinearLayer)


__all__ = ["ColumnParallelLinear", "LinearLayer", "check_shape", "copy_checked", "default_weight_loader",
           "set_weight_attrs", "MergedColumnParallelLinear", "QKVParallelLinear",
           "ReplicatedLinear", "RowParallelLinear", "partition_heads"]
