"""Each sampling bound defined once (asyncengine/sampling_bounds.py), and the wire trusted because of it.

The int64 and float32 bounds are written as literals in the bounds table alone: a scan of every module under
asyncengine/ (its numeric expressions, evaluated, not its text, so `2**63 - 1`, `(1 << 63) - 1` and
`9223372036854775807` are the same finding) fails naming each place that writes one elsewhere. The server's
request Structs, SamplingParams and the wire's SamplingOptions declare their sampling fields with the table's
types, and a message whose values lie past them does not decode: the worker needs no check of its own (these
cases were the worker's `check_sampling_options`' tests, tests/worker/test_logit_controls.py and
tests/worker/test_request_isolation.py, before it was merged away).
"""

from __future__ import annotations

import ast
import math
import operator
import pathlib
import typing

import msgspec
import pytest

from asyncengine import sampling_bounds
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.protocol import CompletionRequest
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions

PACKAGE = pathlib.Path(sampling_bounds.__file__).parent
TABLE = pathlib.Path(sampling_bounds.__file__)

INT_BOUNDS = {2**63 - 1, 2**63, -(2**63), -(2**63) - 1}  # int64's ends, and one past them


def is_float32_bound(value: float) -> bool:
    """float32's largest finite value or its smallest normal one, as written to any precision (3.4e38, 1.18e-38)."""
    magnitude = abs(value)
    return 3.0e38 <= magnitude <= 3.5e38 or 1.1e-38 <= magnitude <= 1.2e-38


_OPERATORS = {ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.Sub: operator.sub, ast.Add: operator.add,
              ast.Mult: operator.mul, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(node: ast.AST) -> int | float | None:
    """The value of a numeric expression of literals (`2**63 - 1`, `-(1 << 63)`), None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        inner = evaluate(node.operand)
        return None if inner is None else _OPERATORS[type(node.op)](inner)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if left is None or right is None or (isinstance(node.op, (ast.Pow, ast.LShift)) and abs(right) > 256):
            return None
        return _OPERATORS[type(node.op)](left, right)
    return None


def bound_literals(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each int64 or float32 bound written as a literal in `source`."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        value = evaluate(node)
        if (isinstance(value, int) and value in INT_BOUNDS) or (isinstance(value, float) and math.isfinite(value)
                                                                 and is_float32_bound(value)):
            found.append((node.lineno, ast.unparse(node)))  # (not its parts: `2**63 - 1` is one finding)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_each_int64_and_float32_bound_is_written_in_the_bounds_table_alone():
    elsewhere = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE
                 for line, text in bound_literals(path.read_text())]
    assert not elsewhere, ("int64/float32 bounds written outside asyncengine/sampling_bounds.py; import them from "
                           "there (or the table's Annotated types):\n" + "\n".join(elsewhere))
    assert len(bound_literals(TABLE.read_text())) >= 4  # the table does write them (the scan sees them)


def test_the_scan_finds_each_way_of_writing_a_bound():
    source = ("A = 2**63 - 1\nB = -(2 ** 63)\nC = (1 << 63) - 1\nD = 9223372036854775807\nE = 3.4028234663852886e38\n"
              "F = 1.1754943508222875e-38\nG = 3.4e38\nH = 2**63\n"
              "MASK = (1 << 64) - 1\nI = 2**31\nJ = 1e-5\n")
    assert [line for line, _ in bound_literals(source)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_three_declarations_use_the_tables_types():
    params = typing.get_type_hints(SamplingParams, include_extras=True)
    http = typing.get_type_hints(CompletionRequest, include_extras=True)
    wire = typing.get_type_hints(SamplingOptions, include_extras=True)
    for name, bound in [("temperature", sampling_bounds.Temperature), ("top_p", sampling_bounds.TopP),
                        ("min_p", sampling_bounds.Probability), ("presence_penalty", sampling_bounds.Penalty),
                        ("repetition_penalty", sampling_bounds.RepetitionPenalty)]:
        assert params[name] == bound and http[name] == bound | None and wire[name] == bound, name
    for name in ("top_k", "n", "seed", "max_tokens", "min_tokens", "logprobs", "truncate_prompt_tokens"):
        assert params[name] in (http[name], typing.get_args(http[name])[0]), name


# -- the wire: a value past the table does not decode ------------------------------------------------------


def wire_request(**sampling) -> bytes:
    return msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1, 2], "sampling": sampling})


@pytest.mark.parametrize("sampling, field", [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**64 - 1}, "top_k"),
    ({"top_k": -1}, "top_k"),  # the frontend sends top_k off as 0
    ({"seed": 2**63}, "seed"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"logit_bias": {3: math.inf}}, "logit_bias"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[3, -1]]}, "bad_words_token_ids"),
], ids=lambda case: str(case))
def test_a_request_whose_values_lie_past_the_table_does_not_decode(sampling, field):
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.sampling\.{field}"):
        msgspec.msgpack.decode(wire_request(**sampling), type=EngineCoreRequest)


def test_values_at_the_tables_edges_decode():
    edges = {"top_k": 2**63 - 1, "seed": -(2**63), "temperature": 3.4e38, "repetition_penalty": 1.2e-38,
             "top_p": 1e-9, "logit_bias": {3: -100.0, 4: 100.0}, "allowed_token_ids": [0]}
    request = msgspec.msgpack.decode(wire_request(**edges), type=EngineCoreRequest)
    assert request.sampling.top_k == 2**63 - 1 and request.sampling.logit_bias == {3: -100.0, 4: 100.0}
