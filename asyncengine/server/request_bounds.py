"""The bounds of a request's fields that come from the server's configuration, put into the request Structs.

A bound that depends on nothing is declared where the field is (protocol.py, protocol_pooling.py:
`msgspec.Meta(ge=..., le=...)`). One that depends on the engine (`n` at most --max-n, token ids within the
vocabulary, `max_tokens` within the context) is declared there too, with a fallback value and the name of its
limit in the Meta's `extra` (`limit("max_n", ge=1)`). `bounded(struct, bounds)` is the Struct with each such
Meta given this server's value: the routes decode request bodies with it (msgspec refuses a value out of
bounds, naming the field) and /openapi.json is generated from it (server/openapi.py), so a bound enforced at
the edge is always the bound published, and one added to a Struct's field reaches both.

Only a Struct's own fields are specialized (through unions, lists and dicts); a nested Struct keeps its
declared bounds.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any

import msgspec

from asyncengine.sampling_bounds import LIMIT_KEY, REASONS, RequestBounds


@functools.lru_cache(maxsize=256)
def bounded(struct: type, bounds: RequestBounds | None) -> type:
    """`struct` with this server's limits in its fields' Meta (the same class when none of its fields has one).
    The subclass keeps the name, so that the document's component and msgspec's errors read the same."""
    if bounds is None:
        return struct
    changed = []
    for info in msgspec.structs.fields(struct):
        new_type = _specialize(info.type, bounds)
        if new_type is not info.type:
            default = info.default if info.default is not msgspec.NODEFAULT else msgspec.NODEFAULT
            if info.default_factory is not msgspec.NODEFAULT:
                default = msgspec.field(default_factory=info.default_factory)
            changed.append((info.name, new_type, default) if default is not msgspec.NODEFAULT
                           else (info.name, new_type))
    if not changed:
        return struct
    config = struct.__struct_config__  # type: ignore[attr-defined]
    specialized = msgspec.defstruct(struct.__name__, changed, bases=(struct,), kw_only=True,
                                    forbid_unknown_fields=config.forbid_unknown_fields, module=struct.__module__)
    specialized.__doc__ = struct.__doc__
    return specialized


def field_limit(struct: type, name: str) -> tuple[str, int] | None:
    """(limit name, value) of the top-level field `name` of a `bounded` Struct, when one limits it."""
    for info in msgspec.structs.fields(struct):
        if info.name == name:
            return _find_limit(info.type)
    return None


def _specialize(tp: Any, bounds: RequestBounds) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, *metas = args
        new_metas = [_bounded_meta(m, bounds) if isinstance(m, msgspec.Meta) else m for m in metas]
        inner = _specialize(base, bounds)
        if inner is base and all(a is b for a, b in zip(new_metas, metas)):
            return tp
        return Annotated[(inner, *new_metas)]
    if not args:
        return tp
    new_args = tuple(_specialize(a, bounds) for a in args)
    if all(a is b for a, b in zip(new_args, args)):
        return tp
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, new_args)
    return origin[new_args]  # list[...], dict[...]


def _bounded_meta(meta: msgspec.Meta, bounds: RequestBounds) -> msgspec.Meta:
    name = (meta.extra or {}).get(LIMIT_KEY)
    value = getattr(bounds, name) if isinstance(name, str) else None
    if value is None or not isinstance(name, str):
        return meta
    described = f"At most {name}={value}: {REASONS[name]}."
    kwargs = {key: getattr(meta, key) for key in ("gt", "ge", "lt", "title", "examples", "extra_json_schema", "extra")
              if getattr(meta, key) is not None}
    description = f"{meta.description} {described}" if meta.description else described
    return msgspec.Meta(le=value, description=description, **kwargs)


def _find_limit(tp: Any) -> tuple[str, int] | None:
    if typing.get_origin(tp) is Annotated:
        for meta in typing.get_args(tp)[1:]:
            if isinstance(meta, msgspec.Meta) and (meta.extra or {}).get(LIMIT_KEY) and meta.le is not None:
                return meta.extra[LIMIT_KEY], int(meta.le)  # type: ignore[index]
    for arg in typing.get_args(tp):
        found = _find_limit(arg)
        if found is not None:
            return found
    return None
