"""Acceptance 3 and 6 of issue 18, in a real multiprocess server (engine core and worker each in a process of
their own): a plugin distribution (tests/plugins/ae-plugin-pooling) registers an embedding architecture, a
pooler (`register_pooler`, EXTENSION_POINTS.md R12) and an IO processor over pooled outputs. The model (a tiny
BERT under the plugin's architecture name) runs with the plugin's pooler, chosen by --pooler-config; the worker
names it in the start-up report; the IO processor answers /pooling with its own response."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from support.pooling_models import build
from support.server import start_server

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 8], list(range(20, 50))]


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return response.status, json.loads(response.read())


@pytest.fixture(scope="module")
def plugin_model(tmp_path_factory):
    model = build("bert", tmp_path_factory.mktemp("ae-pooling-model"))
    config_file = model.path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["AeTinyEmbedding"]  # only the plugin knows this one
    config_file.write_text(json.dumps(config))
    return model


@pytest.mark.extension_point("R12")
def test_a_plugin_embedding_model_and_pooler_in_a_multiprocess_server(plugin_model, plugin_env):
    server = start_server([str(plugin_model.path), "--skip-tokenizer-init", "--dtype", "float32",
                           "--distributed-executor-backend", "mp", "--pooler-config", '{"pooling_type": "ae_max"}',
                           "--io-processor-plugin", "ae_pooling_io"], env=plugin_env("ae-plugin-pooling"))
    try:
        status, answer = post(server, "/v1/embeddings", {"input": PROMPTS})
        assert status == 200, answer
        with torch.no_grad():
            for prompt, item in zip(PROMPTS, answer["data"]):
                hidden = plugin_model.hf_model(torch.tensor([prompt])).last_hidden_state[0]
                expected = torch.nn.functional.normalize(hidden.max(dim=0).values, dim=-1)
                assert (torch.tensor(item["embedding"]) - expected).abs().max() <= 1e-4

        with urllib.request.urlopen(server.url + "/v1/startup") as response:
            records = json.loads(response.read())
        poolers = [r for r in records if r["plugin"] == "pooler"]
        assert [r["role"] for r in poolers] == ["worker rank 0"], poolers
        assert poolers[0]["reason"].startswith("ae_max (ae_plugin_pooling:MaxPooler), chosen by --pooler-config")

        status, answer = post(server, "/pooling", {"data": {"token_ids": PROMPTS}})
        assert status == 200 and answer["object"] == "io_process" and answer["plugin"] == "ae_pooling_io"
        with torch.no_grad():
            expected_argmax = [int(plugin_model.hf_model(torch.tensor([p])).last_hidden_state[0].max(0).values.argmax())
                               for p in PROMPTS]
        assert answer["data"] == {"argmax": expected_argmax, "sizes": [64, 64, 64]}
        assert answer["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    finally:
        server.stop()
