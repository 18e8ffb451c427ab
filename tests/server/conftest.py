"""One real server for the end-to-end server tests: the default model, the engine core in its own
process (serve's default), an API key. Shared by every test module here; stopped with SIGTERM at the
end of the session, which must exit 0."""

from __future__ import annotations

import pytest

from support.server import API_KEY, MODEL_NAME, start_server


@pytest.fixture(scope="session")
def smol_server(default_model_dir):
    server = start_server([str(default_model_dir), "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                           "--max-num-seqs", "64", "--max-waiting-requests", "64"])
    yield server
    assert server.stop() == 0, server.stderr()[-3000:]


@pytest.fixture(scope="session")
def smol_llm(default_model_dir):
    """The same model in this process: the engine's own greedy outputs, to compare the server's with."""
    from asyncengine import LLM

    llm = LLM(str(default_model_dir), served_model_name=MODEL_NAME)
    yield llm
    llm.close()
