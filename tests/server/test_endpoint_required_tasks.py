"""An endpoint plugin's required_tasks (vLLM's) against what the server serves, by the runner: checked with
the other contracts when the runner is given ("generate", "pooling"), and by the server when it is
"auto", once the model has resolved it. vLLM leaves such a plugin out silently; here start-up fails
naming it. The vLLM-shaped distribution, refused at start-up: tests/e2e/test_vllm_shaped_endpoint.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncengine.errors import StartupError
from asyncengine.interfaces.endpoint import required_tasks_problem, served_tasks
from asyncengine.server.fastapi_endpoints import served_endpoint_plugins


class EmbedOnly:  # vLLM's form
    name = "embed_only"
    required_tasks = ("embed",)

    def attach_router(self, app):
        pass


class Anything(EmbedOnly):
    name = "anything"
    required_tasks = None


def engine(runner):
    return SimpleNamespace(model_config=SimpleNamespace(runner=runner), config=None)


def test_the_runner_decides_the_tasks_and_auto_waits_for_the_model():
    assert served_tasks("generate") == ("generate",)
    assert "embed" in served_tasks("pooling")
    assert served_tasks("auto") is None
    assert required_tasks_problem(EmbedOnly(), "auto") is None  # not known yet: the server checks
    assert required_tasks_problem(EmbedOnly(), "pooling") is None
    assert required_tasks_problem(EmbedOnly(), "generate").startswith(
        "requires one of the tasks embed, and this server serves generate")
    bad = type("Bad", (EmbedOnly,), {"required_tasks": "embed"})()
    assert "give a tuple of task names" in required_tasks_problem(bad, "auto")


def test_the_server_refuses_a_plugin_the_resolved_model_does_not_serve():
    with pytest.raises(StartupError, match=r"endpoint plugin 'embed_only' \(test_endpoint_required_tasks:EmbedOnly\) "
                                           r"requires one of the tasks embed, and this server serves generate"):
        served_endpoint_plugins([Anything(), EmbedOnly()], engine("generate"), None)
    served = served_endpoint_plugins([Anything(), EmbedOnly()], engine("pooling"), None)
    assert [plugin.name for plugin in served] == ["anything", "embed_only"]
