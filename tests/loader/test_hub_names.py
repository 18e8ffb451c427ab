"""Model names as users write them (loader/hub.py, loader/model_source.py): `ORG/NAME` from a hub-shaped cache
folder the test builds, offline (HF_HUB_OFFLINE=1) through `LLM` and through `asyncengine serve` with the official
client; the download path through a local stand-in of the hub's file API (HF_ENDPOINT); revisions, `--tokenizer`
and `--hf-config-path` as hub names, `ORG/NAME:QUANT` for a GGUF repository, and the one clear error when the name
is absent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.errors import ModelLoadError
from asyncengine.loader.model_source import resolve_files_dir, resolve_model_dir
from support.hub_standin import HubStandIn, hub_cache_with
from support.server import start_server
from support.tiny_gguf import TinySpec, write_tiny_gguf
from support.tiny_models import build_tiny_model
from support.tiny_tokenizer import save_tiny_tokenizer

REPO = "tiny-org/tiny-llama"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32, plugins="")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hub-model")
    build_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def expected_tokens(model_dir) -> list[int]:
    with LLM(str(model_dir), **OPTIONS) as llm:
        return llm.generate(["Hello there"], PARAMS)[0].outputs[0].token_ids


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A clean hub environment: the cache in tmp_path, no endpoint, online unless a test says otherwise."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_name_in_the_cache_runs_offline(hub_env, monkeypatch, model_dir, expected_tokens):
    snapshot = hub_cache_with(hub_env, REPO, model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir(REPO) == snapshot
    with LLM(REPO, **OPTIONS) as llm:
        assert llm.generate(["Hello there"], PARAMS)[0].outputs[0].token_ids == expected_tokens


def test_hf_home_download_dir_and_revision_choose_the_snapshot(hub_env, monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    main = hub_cache_with(tmp_path / "home" / "hub", REPO, model_dir)
    tagged = hub_cache_with(tmp_path / "home" / "hub", REPO, model_dir, revision="v1", commit=OTHER_COMMIT)
    assert resolve_model_dir(REPO) == main
    assert resolve_model_dir(REPO, revision="v1") == tagged
    assert resolve_model_dir(REPO, revision=OTHER_COMMIT) == tagged
    elsewhere = hub_cache_with(tmp_path / "downloads", REPO, model_dir)
    assert resolve_model_dir(REPO, cache_dir=str(tmp_path / "downloads")) == elsewhere


def test_an_absent_name_offline_is_one_clear_error(hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        LLM("tiny-org/not-downloaded", **OPTIONS)
    message = str(info.value)
    assert "'tiny-org/not-downloaded'" in message and str(hub_env) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelLoadError, match=r"revision 'v2'.*not in the Hugging Face cache"):
        resolve_model_dir(REPO, revision="v2")


def test_a_name_downloads_through_the_hub_file_api(hub_env, monkeypatch, model_dir, expected_tokens):
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"never fetched: the engine reads safetensors"
    with HubStandIn({REPO: files}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with LLM(REPO, **OPTIONS) as llm:
            assert llm.generate(["Hello there"], PARAMS)[0].outputs[0].token_ids == expected_tokens
        fetched = {request.rsplit("/", 1)[-1] for request in hub.requests if request.startswith("GET /tiny-org")}
        assert fetched == set(files) - {"pytorch_model.bin"}  # what the engine reads, not the .bin
        assert f"GET /api/models/{REPO}/revision/main" in hub.requests
        with pytest.raises(ModelLoadError, match=r"'tiny-org/absent' is not a local path, and http://127\.0\.0\.1"):
            resolve_model_dir("tiny-org/absent")
        with pytest.raises(ModelLoadError, match=r"has no revision 'v9'"):
            resolve_model_dir(REPO, revision="v9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the stand-in is gone: the cache answers
    assert (resolve_model_dir(REPO) / "model.safetensors").is_file()


def test_a_gguf_repository_by_quant_type_or_file(hub_env, monkeypatch, tmp_path):
    spec = TinySpec("qwen2", "gpt2", tied=True, kv_heads=4)
    data = write_tiny_gguf(tmp_path / "q.gguf", spec).read_bytes()
    files = {"tiny-qwen2-Q8_0.gguf": data, "tiny-qwen2-Q4_K_M.gguf": data, "README.md": b"GGUF files"}
    with HubStandIn({"tiny-org/tiny-GGUF": files}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        converted = resolve_model_dir("tiny-org/tiny-GGUF:q4_k_m", cache_dir=str(tmp_path / "dl"), progress=False)
        assert json.loads((converted / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
        downloads = [r for r in hub.requests if r.startswith("GET /tiny-org")]
        assert downloads == ["GET /tiny-org/tiny-GGUF/resolve/main/tiny-qwen2-Q4_K_M.gguf"]  # that file alone
        same = resolve_model_dir("tiny-org/tiny-GGUF/tiny-qwen2-Q8_0.gguf", cache_dir=str(tmp_path / "dl"),
                                 progress=False)
        assert (same / "model.safetensors").is_file()
        with pytest.raises(ModelLoadError, match=r"no \.gguf file named for 'Q5_K_M'.*tiny-qwen2-Q8_0\.gguf"):
            resolve_model_dir("tiny-org/tiny-GGUF:Q5_K_M", cache_dir=str(tmp_path / "dl"))
        with pytest.raises(ModelLoadError, match=r"no config.json.*tiny-org/tiny-GGUF:QUANT"):
            resolve_model_dir("tiny-org/tiny-GGUF", cache_dir=str(tmp_path / "dl"))


def test_tokenizer_and_hf_config_path_as_hub_names(hub_env, monkeypatch, tmp_path, model_dir):
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tokenizer_only / name)
    hub_cache_with(hub_env, "tiny-org/tokenizer", tokenizer_only)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (config_only / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    hub_cache_with(hub_env, "tiny-org/config", config_only)
    model_only = tmp_path / "weights-only"
    model_only.mkdir()
    shutil.copy(model_dir / "model.safetensors", model_only / "model.safetensors")
    shutil.copy(model_dir / "config.json", model_only / "config.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (resolve_files_dir("tiny-org/tokenizer", cache_dir=None, revision=None, what="tokenizer")
            / "tokenizer.json").is_file()
    from types import SimpleNamespace

    from asyncengine.config.engine import EngineConfig
    from asyncengine.frontend.startup import prepare

    config = EngineConfig(model=str(model_only), tokenizer="tiny-org/tokenizer", hf_config_path="tiny-org/config",
                          plugins="")
    setup = prepare(config, SimpleNamespace(default_dtype="float32"), progress=False)
    assert setup.model_config.max_model_len == 96  # from tiny-org/config's config.json
    assert setup.model_config.tokenizer_dir == str(hub_env / "models--tiny-org--tokenizer" / "snapshots" /
                                                   "0123456789abcdef0123456789abcdef01234567")
    with LLM(str(model_only), tokenizer="tiny-org/tokenizer", hf_config_path="tiny-org/config",
             **{**OPTIONS, "max_model_len": 64}) as llm:
        output = llm.generate(["Hello there"], PARAMS)[0]
    assert output.prompt_token_ids == setup.tokenizer.encode("Hello there") and len(output.outputs[0].token_ids) == 6


@pytest.mark.slow
def test_serve_org_name_offline_to_the_official_client(hub_env, model_dir):
    import os

    import openai

    hub_cache_with(hub_env, REPO, model_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_env)}
    env.pop("HF_ENDPOINT", None)
    server = start_server([REPO, "--dtype", "float32", "--max-model-len", "128", "--plugins", ""], env=env)
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [REPO]
            completion = client.completions.create(model=REPO, prompt="Hello there", max_tokens=6, temperature=0,
                                                   extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 6
    finally:
        server.stop()
