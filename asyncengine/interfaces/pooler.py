"""Pooler: the interface of a pooling model's pooler (the built-in LAST, MEAN, CLS and ALL included), and
the registry that names them (PoolerRegistry, docs/reference.md R12, read in the worker).

A pooler turns the final hidden states of each pooling request's prompt into that request's output: the
worker hands it the step's pooling requests as one run of rows, `hidden_states` `[sum(lengths), hidden]`,
request after request, with `lengths` their prompt lengths, and it returns one tensor per request (a
vector for the sequence-level poolers, `[length, hidden]` for ALL). What follows it is the engine's, per
request: `dimensions` (Matryoshka truncation) and L2 normalization for embeddings, softmax or sigmoid for
class scores (asyncengine/pooling/step.py).

Chosen by `--pooler-config '{"pooling_type": "NAME"}'`, else by the model's files (sentence-transformers'
1_Pooling/config.json), else by the model class (docs/pooling.md). No torch import here:
`asyncengine.plugins_api` exports this class without torch.
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.registry import BUILT_IN, Registry, reads


class Pooler:
    """Subclass it, implement `pool`, and register the class (or its "pkg.mod:Class" path) with
    `register_pooler("NAME", ...)` from a general plugin (the worker reads the registry).

    Built once per worker as `cls(hf_config)`, with the model's config as attributes (`hidden_size`, ...).
    A pooler with weights of its own is an `nn.Module` too, and loads them itself."""

    def __init__(self, hf_config: Any = None) -> None:
        self.hf_config = hf_config

    def pool(self, hidden_states: Any, lengths: list[int]) -> list[Any]:
        raise NotImplementedError(f"{type(self).__qualname__} must implement pool(hidden_states, lengths)")


# The built-in pooling types, as vLLM names them.
BUILTIN_POOLERS = {
    "LAST": "asyncengine.pooling.poolers:LastPooler",
    "MEAN": "asyncengine.pooling.poolers:MeanPooler",
    "CLS": "asyncengine.pooling.poolers:ClsPooler",
    "ALL": "asyncengine.pooling.poolers:AllPooler",
}


class _PoolerRegistry(Registry[type[Pooler]]):
    def __init__(self) -> None:
        super().__init__(
            "poolers", "pooler", Pooler, field="pooler_config",
            unknown="pooler {key!r} (pooler_config's pooling_type) is not registered; registered: {known} (a plugin "
                    "adds one with register_pooler, from a general plugin so that the worker processes have it too)")
        for name, path in BUILTIN_POOLERS.items():  # by path: the table imports no torch
            self.register(name, path, owner=BUILT_IN)

    @reads("poolers", "worker")
    def pooler_class(self, name: str) -> type[Pooler]:
        """The class registered under `name`; an unknown name lists the registered ones."""
        return self.load(name)


PoolerRegistry = _PoolerRegistry()


def register_pooler(name: str, pooler: Any, *, override: bool = False) -> None:
    """`register_pooler("NAME", "pkg.mod:Pooler")` (or the class): a pooler `--pooler-config` can name."""
    PoolerRegistry.register(name, pooler, override=override)


__all__ = ["BUILTIN_POOLERS", "Pooler", "PoolerRegistry", "register_pooler"]
