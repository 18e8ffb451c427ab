"""LoRA over HTTP with the official client, on one real server for the module (the tiny Llama with the byte
tokenizer): the adapter chosen by `model`, /v1/models listing adapters under their base, concurrent streams
of two adapters and the base model, runtime load and unload behind --enable-runtime-lora-updates and the
API key, the built-in filesystem resolver and a resolver plugin distribution supplying adapters on first
use, a raising resolver failing only that request (naming it), and an unknown name a 404 naming it. An
adapter peft made for another model (the tiny Qwen2, hidden 64, not 96) is refused when loaded, by
POST /v1/load_lora_adapter, by a resolver and by --lora-modules at start-up, naming the layer and both
shapes, and is never registered. Adapter files are read within limits (depth, size) and only as regular
files (a FIFO or a device is refused at once), and no adapter takes the served model's name (issue 30)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import urllib.error
import urllib.request

import openai
import pytest

from support.lora_adapters import make_adapter
from support.server import ServerDidNotStart, start_server
from support.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

KEY = "lora-key"
BASE = "tiny-base"
PROMPT = "The adapters"
EXTRA = {"ignore_eos": True}


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def server(tiny_model, peft, tmp_path_factory, plugin_target):
    tiny = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora-server")
    model_dir = root / "model"
    shutil.copytree(tiny.path, model_dir)
    save_tiny_tokenizer(model_dir)
    make = lambda directory, name, seed, targets: make_adapter(  # noqa: E731
        peft, tiny.path, directory / name, name=name, rank=4, targets=targets, seed=seed)
    started = root / "started"
    resolver_dir = root / "resolver-dir"
    plugin_dir = root / "plugin-dir"
    runtime_dir = root / "runtime"
    make(started, "a1", 11, ["q_proj", "v_proj", "down_proj"])
    make(runtime_dir, "a2", 12, ["k_proj", "o_proj", "gate_proj", "up_proj"])
    make(resolver_dir, "fs-adapter", 13, ["q_proj", "k_proj"])
    make(plugin_dir, "plugin-adapter", 14, ["v_proj", "up_proj"])
    # Made for another base model (the tiny Qwen2: hidden 64): its q_proj matrices are (4, 64) and (64, 4).
    for directory in (runtime_dir, resolver_dir):
        make_adapter(peft, tiny_model("qwen2").path, directory / "other-model", name="other-model", rank=4,
                     targets=["q_proj", "v_proj"], seed=15)
    running = start_server(
        [str(model_dir), "--served-model-name", BASE, "--api-key", KEY, "--dtype", "float32", "--enable-lora",
         "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a1={started / 'a1'}",
         "--lora-resolver-dir", str(resolver_dir), "--enable-runtime-lora-updates", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(16 * 2**20)],
        env={**{k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")},
             "PYTHONPATH": str(plugin_target("ae-plugin-lora-resolver")), "AE_TEST_LORA_DIR": str(plugin_dir)})
    yield running, runtime_dir
    assert running.stop() == 0, running.stderr()[-3000:]


@pytest.fixture
def client(server):
    running, _ = server
    with openai.OpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0, timeout=120) as made:
        yield made


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=EXTRA)
    return out.choices[0].text


def test_models_lists_adapters_with_their_base_as_parent(client):
    cards = {card.id: card for card in client.models.list().data}
    assert BASE in cards and "a1" in cards
    assert cards["a1"].parent == BASE
    # a response names the adapter that ran
    assert client.completions.create(model="a1", prompt=PROMPT, max_tokens=2).model == "a1"
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "a1"


def test_two_adapters_and_the_base_stream_concurrently(server, client):
    running, runtime_dir = server
    status, text = _post(f"{running.url}/v1/load_lora_adapter",
                         {"lora_name": "a2", "lora_path": str(runtime_dir / "a2")})
    assert status == 200, text
    alone = {model: _complete(client, model) for model in (BASE, "a1", "a2")}
    assert len(set(alone.values())) == 3, f"adapters and base must differ: {alone}"
    streamed: dict[str, str] = {}

    def stream(model: str) -> None:
        parts = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                          extra_body=EXTRA)
        streamed[model] = "".join(chunk.choices[0].text for chunk in parts if chunk.choices)

    threads = [threading.Thread(target=stream, args=(model,)) for model in (BASE, "a1", "a2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert streamed == alone
    # Unloaded: the name is gone (a 404 naming it), and so is its card.
    status, text = _post(f"{running.url}/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200, text
    with pytest.raises(openai.NotFoundError, match="a2"):
        _complete(client, "a2")
    assert "a2" not in {card.id for card in client.models.list().data}


def test_runtime_updates_need_the_api_key(server):
    running, runtime_dir = server
    status, _ = _post(f"{running.url}/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(runtime_dir / "a2")},
                      key=None)
    assert status == 401


@pytest.mark.extension_point("R11")
def test_resolvers_supply_adapters_on_first_use(client):
    base = _complete(client, BASE)
    from_dir = _complete(client, "fs-adapter")  # the built-in filesystem resolver (--lora-resolver-dir)
    from_plugin = _complete(client, "plugin-adapter")  # the plugin distribution's resolver
    assert len({base, from_dir, from_plugin}) == 3
    cards = {card.id for card in client.models.list().data}
    assert {"fs-adapter", "plugin-adapter"} <= cards


@pytest.mark.extension_point("R11")
def test_a_raising_resolver_fails_that_request_naming_it(client):
    with pytest.raises(openai.InternalServerError, match="explosive"):
        _complete(client, "explode-now")
    assert _complete(client, BASE)  # the server goes on


@pytest.mark.extension_point("R11")
def test_an_adapter_nobody_has_is_a_404_naming_the_model(client):
    with pytest.raises(openai.NotFoundError, match="no-such-adapter") as caught:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.extension_point("R11")
def test_the_startup_report_names_the_adapters_and_resolvers(server):
    running, _ = server
    request = urllib.request.Request(f"{running.url}/v1/startup", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        records = json.loads(response.read())
    lora = [record for record in records if record.get("plugin") == "lora"]
    assert len(lora) == 1 and lora[0]["outcome"] == "ok", lora
    assert "a1=" in lora[0]["reason"] and "filesystem (built-in" in lora[0]["reason"]
    assert "env_dir (by plugin 'ae_lora_resolver'" in lora[0]["reason"] and "explosive" in lora[0]["reason"]


# The message of a refused misfit: the adapter, the layer, its shapes and the model's, and what to do.
MISFIT = (r"LoRA adapter 'other-model' \(.*other-model\): layer \d q_proj: lora_A \(4, 64\) and lora_B \(64, 4\) "
          r"do not fit this model \(tiny-base\), which needs lora_A \(4, 96\) and lora_B \(96, 4\) at r=4: "
          r"load an adapter trained for this base model")


def test_an_adapter_for_another_model_is_refused_at_load_and_not_registered(server, client):
    running, runtime_dir = server
    status, text = _post(f"{running.url}/v1/load_lora_adapter",
                         {"lora_name": "misfit", "lora_path": str(runtime_dir / "other-model")})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert re.search(MISFIT.replace("'other-model'", "'misfit'"), error["message"]), error
    assert error["code"] == "lora_adapter_mismatch" and error["param"] == "lora_request.lora_path"
    assert "misfit" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="misfit"):  # as for any unknown name
        _complete(client, "misfit")
    # Nothing was registered: the name is free for an adapter that fits, which then serves.
    status, text = _post(f"{running.url}/v1/load_lora_adapter",
                         {"lora_name": "misfit", "lora_path": str(runtime_dir / "a2")})
    assert status == 200, text
    assert _complete(client, "misfit") != _complete(client, BASE)
    assert _complete(client, "a1") != _complete(client, BASE)  # the adapters loaded at start serve on
    status, text = _post(f"{running.url}/v1/unload_lora_adapter", {"lora_name": "misfit"})
    assert status == 200, text


@pytest.mark.extension_point("R11")
def test_a_resolved_adapter_for_another_model_is_refused_and_not_kept(client):
    for _ in range(2):  # asked again, the resolver finds it again and it is refused again: never kept
        with pytest.raises(openai.BadRequestError) as caught:
            _complete(client, "other-model")
        assert re.search(MISFIT, caught.value.body["message"]), caught.value.body
        assert "resolver 'filesystem (built-in)' found 'other-model'" in caught.value.body["message"]
    assert "other-model" not in {card.id for card in client.models.list().data}
    # a resolved adapter that fits still serves
    assert client.completions.create(model="fs-adapter", prompt=PROMPT, max_tokens=2).model == "fs-adapter"


def test_lora_modules_with_an_adapter_for_another_model_fail_start_up(server, tiny_model):
    _, runtime_dir = server
    with pytest.raises(ServerDidNotStart) as caught:
        start_server([str(tiny_model("llama").path), "--served-model-name", BASE, "--skip-tokenizer-init",
                      "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                      f"other-model={runtime_dir / 'other-model'}", "--max-model-len", "64",
                      "--num-gpu-blocks-override", "8"])
    assert caught.value.returncode == 2  # a configuration error
    assert re.search("lora_modules other-model: " + MISFIT, caught.value.stderr), caught.value.stderr[-3000:]


def _broken_adapter(runtime_dir, name: str, good: str = "a2"):
    """A copy of adapter `good` in runtime_dir/name, for a test to break one of its files."""
    directory = runtime_dir / name
    shutil.copytree(runtime_dir / good, directory)
    return directory


def test_adapter_files_are_read_within_limits_and_only_as_regular_files(server, client):
    """Issue 30, item 10: a config nested 100,000 deep was a 500 (RecursionError); a FIFO as a file blocked
    the request until someone wrote to it. Each is a 400 naming what is wrong, answered at once."""
    running, runtime_dir = server
    deep = _broken_adapter(runtime_dir, "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    huge = _broken_adapter(runtime_dir, "huge")
    config = json.loads((huge / "adapter_config.json").read_text())
    (huge / "adapter_config.json").write_text(json.dumps({**config, "padding": "x" * (1 << 20)}))
    fifo_config = _broken_adapter(runtime_dir, "fifo-config")
    (fifo_config / "adapter_config.json").unlink()
    os.mkfifo(fifo_config / "adapter_config.json")
    fifo_weights = _broken_adapter(runtime_dir, "fifo-weights")
    (fifo_weights / "adapter_model.safetensors").unlink()
    os.mkfifo(fifo_weights / "adapter_model.safetensors")
    device = _broken_adapter(runtime_dir, "device")
    (device / "adapter_model.safetensors").unlink()
    (device / "adapter_model.safetensors").symlink_to("/dev/zero")
    expected = {deep: "nested more than 32 levels deep", huge: "more than the 1048576 bytes allowed",
                fifo_config: "adapter_config.json is a FIFO", fifo_weights: "adapter_model.safetensors is a FIFO",
                device: "adapter_model.safetensors is a device"}
    for directory, words in expected.items():
        status, text = _post(f"{running.url}/v1/load_lora_adapter",
                             {"lora_name": directory.name, "lora_path": str(directory)})  # urllib: 60 s at most
        assert status == 400, (directory.name, text)
        error = json.loads(text)["error"]
        assert words in error["message"] and error["param"].startswith("lora_request."), error
        assert directory.name not in {card.id for card in client.models.list().data}
    assert _complete(client, "a1") != _complete(client, BASE)  # and the server serves on


def test_an_adapter_may_not_take_the_served_model_name(server, client):
    running, runtime_dir = server
    status, text = _post(f"{running.url}/v1/load_lora_adapter",
                         {"lora_name": BASE, "lora_path": str(runtime_dir / "a2")})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "lora_name" and error["code"] == "lora_name_taken", error
    assert "served model's name" in error["message"]
    assert [card.id for card in client.models.list().data].count(BASE) == 1  # listed once, as the model
