"""The claim's validator and the executor class, without an engine (tests/e2e/test_extension_point_rows.py
in asyncengine runs them in one)."""

from __future__ import annotations

import pytest

from ae_executor_example import EXECUTOR_PATH, validate_options
from asyncengine.plugins_api import MultiprocExecutor


@pytest.mark.parametrize("value", [{}, {"label": "x"}, {"label": "x", "record_steps": False}])
def test_accepted_options(value):
    validate_options(value)


@pytest.mark.parametrize(("value", "says"), [
    ([], "expected a dict"),
    ({"lable": "x"}, "unknown option(s) ['lable']"),
    ({"record_steps": "yes"}, "option 'record_steps' must be a bool"),
])
def test_refused_options_say_why(value, says):
    with pytest.raises(ValueError) as caught:
        validate_options(value)
    assert says in str(caught.value)


def test_the_executor_path_names_a_multiproc_executor_subclass():
    import importlib

    module, _, name = EXECUTOR_PATH.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, MultiprocExecutor) and cls is not MultiprocExecutor
