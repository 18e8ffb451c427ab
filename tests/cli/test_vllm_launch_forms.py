"""vLLM launch scripts work (issue 32, item 4): every form a vLLM launch command uses starts the server or fails
before the model loads with a message naming the flag. Parse-level in-process through the real parser
(`asyncengine serve`'s), one real `serve` started from a YAML --config with vLLM's flags."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from asyncengine.cli.main import build_parser, main
from asyncengine.cli.serve import configs_from_args
from asyncengine.config.model import complete_hf_config, load_config_json
from asyncengine.errors import ConfigError
from asyncengine.frontend.tokenizer import load_tokenizer
from support.server import start_server
from support.tiny_tokenizer import save_tiny_tokenizer


def serve_configs(*argv: str):
    """The engine's and the server's config `asyncengine serve ARGV` starts with (nothing is started)."""
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def usage_error(capsys, *argv: str) -> str:
    """`asyncengine serve ARGV` refused by the parser: exit status 2, and its message."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_model_is_the_model_and_no_flag_is_guessed_from_a_prefix(capsys):
    engine, _ = serve_configs("--model", "/models/x")
    assert engine.model == "/models/x" and engine.model_class_overrides == {}
    assert serve_configs("--model=/models/x")[0].model == serve_configs("/models/x")[0].model == "/models/x"
    for abbreviation in ("--mod", "--max-model", "--served", "--enable-prefix"):
        assert f"unrecognized arguments: {abbreviation}" in usage_error(capsys, abbreviation, "1")
    with pytest.raises(ConfigError, match="the model is given twice: MODEL '/a' and --model '/b'") as caught:
        serve_configs("/a", "--model", "/b")
    assert caught.value.field == "model"


def test_flags_that_take_several_values_take_them_as_vllm_does():
    engine, server = serve_configs("/m", "--served-model-name", "first", "second", "--enable-lora",
                                   "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat"}',
                                   "--api-key", "k1", "--api-key", "k2,with-comma", "--middleware", "a:b", "c:d")
    assert engine.served_model_names == ["first", "second"]  # the first is the one reported
    assert engine.lora_modules == ["sql=/a/sql", {"name": "chat", "path": "/a/chat"}]
    assert server.api_keys == ["k1", "k2,with-comma"]  # a key is taken whole
    assert server.middleware == ["a:b", "c:d"]
    assert serve_configs("--api-key", "k1", "k2")[1].api_keys == ["k1", "k2"]
    assert serve_configs("--served-model-name", "one")[0].served_model_name == "one"
    assert serve_configs("--lora-modules", "a=/p", "--lora-modules", "b=/q,c=/r", "--enable-lora")[0].lora_modules == [
        "a=/p", "b=/q", "c=/r"]


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                              ("float", "float32"), ("float32", "float32"), ("auto", "auto")])
def test_dtype_takes_vllm_names(given, dtype):
    assert serve_configs("--dtype", given)[0].dtype == dtype


@pytest.mark.parametrize(("given", "tokens"), [
    ("auto", None), ("-1", None), ("4k", 4000), ("4K", 4096), ("1m", 1_000_000), ("1M", 2**20), ("25.6k", 25_600),
    ("2048", 2048)])
def test_max_model_len_takes_vllm_forms(given, tokens):
    assert serve_configs("--max-model-len", given)[0].max_model_len == tokens  # None: the model's own length


def test_vllm_flags_map_to_their_options():
    engine, server = serve_configs("--trust-remote-code", "--kv-cache-dtype", "auto", "--enable-log-requests",
                                   "--max-log-len", "100", "--uvicorn-log-level", "trace", "--max_num_seqs", "8",
                                   "--max-num-batched-tokens", "8k", "--kv-cache-memory-bytes", "1G")
    assert engine.trust_remote_code and engine.kv_cache_dtype == "auto"
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.kv_cache_memory_bytes) == (8, 8000, 2**30)
    assert server.enable_log_requests and server.max_log_len == 100 and server.log_level_of_requests == "DEBUG"
    assert serve_configs("--disable-log-requests")[1].disable_log_requests


def test_uvicorn_log_level_sets_hypercorns_and_the_request_lines_level():
    from asyncengine.server.app import REQUEST_LOGGER
    from asyncengine.server.config import ServerConfig
    from asyncengine.server.run import hypercorn_config

    loggers = [logging.getLogger(name) for name in ("hypercorn.error", REQUEST_LOGGER)]
    saved = [logger.level for logger in loggers]
    try:
        hypercorn_config(ServerConfig(uvicorn_log_level="warning"))
        assert [logger.level for logger in loggers] == [logging.WARNING, logging.WARNING]
    finally:
        for logger, level in zip(loggers, saved):
            logger.setLevel(level)


@pytest.mark.parametrize(("argv", "field", "words"), [
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "'fp8' is not built here"),
    (["--dtype", "int4"], "dtype", "half, float"),
    (["--uvicorn-log-level", "loud"], "uvicorn_log_level", "critical, error, warning, info, debug, trace"),
    (["--enable-log-requests", "--disable-log-requests"], "enable_log_requests", "contradict"),
    (["--served-model-name", ""], "served_model_name", "non-empty"),
])
def test_a_value_that_cannot_be_served_names_its_option(argv, field, words):
    with pytest.raises(ConfigError, match=words) as caught:
        serve_configs(*argv)
    assert caught.value.field == field


def test_a_malformed_number_is_a_usage_error_naming_the_flag(capsys):
    assert "argument --max-model-len: '4.5K': a binary suffix (K) takes a whole number; did you mean 4.5k?" in \
        usage_error(capsys, "--max-model-len", "4.5K")
    assert "argument --max-num-seqs: 'lots' is not an integer" in usage_error(capsys, "--max-num-seqs", "lots")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_yaml_config_file_as_vllm_writes_it(tmp_path, capsys):
    config = write(tmp_path / "serve.yaml", """
model: /models/from-file
max_model_len: 4k
served-model-name: [first, second]
enable-prefix-caching: false
trust-remote-code: true
api-key: [k1, k2]
hf_overrides: {rope_theta: 500000}
port: 9000
tool-call-parser: null
""")
    engine, server = serve_configs("--config", config)
    assert (engine.model, engine.max_model_len, engine.served_model_names) == ("/models/from-file", 4000,
                                                                                ["first", "second"])
    assert not engine.enable_prefix_caching and engine.trust_remote_code and engine.hf_overrides == {
        "rope_theta": 500000}
    assert (server.api_keys, server.port, server.tool_call_parser) == (["k1", "k2"], 9000, None)
    # The command line wins, flag by flag: a value, a list (replaced, not joined), the model.
    engine, server = serve_configs("/models/cli", f"--config={config}", "--port", "1", "--api-key", "k9",
                                   "--max_model_len", "auto", "--enable-prefix-caching")
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching) == ("/models/cli", None, True)
    assert (server.port, server.api_keys) == (1, ["k9"])
    assert serve_configs("--model", "/models/flag", "--config", config)[0].model == "/models/flag"
    # What a file gets wrong is a usage error naming --config, the file and the key.
    for text, words in (("max-model-len: 4096\nno-such-option: 1\n", "'no-such-option' names no option"),
                        ("- a list\n", "must be a mapping"), ("port: [1, 2]\n", "'port' takes one value"),
                        ("port: {\n", "is not valid YAML")):
        assert f"--config {tmp_path / 'bad.yaml'}: {words}" in usage_error(
            capsys, "--config", write(tmp_path / "bad.yaml", text))
    assert "must be YAML (.yaml or .yml)" in usage_error(capsys, "--config", write(tmp_path / "serve.json", "{}"))
    assert "cannot be read" in usage_error(capsys, "--config", str(tmp_path / "missing.yaml"))


def test_generate_and_launch_render_read_a_config_file_too(tmp_path):
    config = write(tmp_path / "engine.yaml", "model: /models/from-file\nmax-model-len: 2K\ndtype: half\n")
    args = build_parser().parse_args(["generate", "hello", "--config", config])
    assert (args.model, args.max_model_len, args.dtype, args.prompt) == ("/models/from-file", 2048, "half", "hello")
    engine, _ = configs_from_args(build_parser().parse_args(["launch", "render", "--config", config]))
    assert (engine.model, engine.max_model_len, engine.dtype) == ("/models/from-file", 2048, "float16")


def test_every_flag_has_a_one_line_description():
    import argparse

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # serve, generate, launch, plugins
    render = commands["launch"]._subparsers._group_actions[0].choices["render"]
    for command in (commands["serve"], commands["generate"], render):
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            help_text = action.help or ""
            description = help_text.split(" (default: ")[0].strip()
            assert len(description) > 10 and "\n" not in help_text, (command.prog, action.option_strings, help_text)


def test_an_unknown_attention_backend_fails_before_the_model_is_looked_for(tmp_path):
    # The model does not exist: an error about the name, not about the model, shows the check came first.
    result = subprocess.run([sys.executable, "-m", "asyncengine", "serve", str(tmp_path / "no-model"),
                             "--attention-backend", "NO_SUCH_BACKEND", "--port", "0"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr
    assert "attention backend 'NO_SUCH_BACKEND' (chosen by the attention_backend option) is not registered; " \
           "registered: TORCH_PAGED" in result.stderr and "no-model" not in result.stderr, result.stderr


def test_an_unknown_quantization_fails_before_the_model_is_looked_for(tmp_path):
    from asyncengine.config.engine import EngineConfig
    from asyncengine.frontend.startup import prepare

    with pytest.raises(ConfigError, match="quantization 'no_such_method' names no quantization method; known: ") \
            as caught:
        prepare(EngineConfig(model=str(tmp_path / "no-model"), quantization="no_such_method"), platform=None)
    assert caught.value.field == "quantization"


def test_trust_remote_code_reaches_transformers_for_the_config_and_the_tokenizer(tmp_path):
    (tmp_path / "configuration_custom.py").write_text(
        "from transformers import PretrainedConfig\n\n\nclass CustomConfig(PretrainedConfig):\n"
        "    model_type = 'custom_remote'\n\n    def __init__(self, remote_default=7, **kwargs):\n"
        "        self.remote_default = remote_default\n        super().__init__(**kwargs)\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "custom_remote", "architectures": ["X"],
                                                      "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    raw = load_config_json(tmp_path)
    assert complete_hf_config(tmp_path, raw, {}, trust_remote_code=True)["remote_default"] == 7  # its code ran
    assert "remote_default" not in complete_hf_config(tmp_path, raw, {})
    save_tiny_tokenizer(tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n")
    assert type(load_tokenizer(tmp_path, trust_remote_code=True)).__name__ == "CustomTokenizerFast"
    assert type(load_tokenizer(tmp_path)).__name__ != "CustomTokenizerFast"


@pytest.mark.slow
def test_a_vllm_style_launch_with_a_yaml_config_starts_the_server(tiny_model, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(tiny_model("llama").path, model)
    save_tiny_tokenizer(model)
    config = write(tmp_path / "vllm.yaml", f"""
served_model_name: [tiny, tiny-alias]
max-model-len: 0.5k
dtype: half
api-key: [first-key, second-key]
enable-log-requests: true
max-log-len: 30
kv-cache-memory-bytes: 16M
""")
    server = start_server(["--model", str(model), "--config", config, "--trust-remote-code", "--kv-cache-dtype",
                           "auto", "--disable_log_requests", "--no-disable-log-requests", "--max-num-seqs", "4"])
    try:
        def call(path: str, body: dict | None = None, key: str = "second-key") -> dict:
            request = urllib.request.Request(server.url + path, data=None if body is None else json.dumps(body).encode(),
                                             headers={"Authorization": f"Bearer {key}",
                                                      "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())

        assert [card["id"] for card in call("/v1/models")["data"]] == ["tiny", "tiny-alias"]
        completion = call("/v1/completions", {"model": "tiny-alias", "prompt": "hello", "max_tokens": 2}, "first-key")
        assert completion["model"] == "tiny" and completion["usage"]["completion_tokens"] == 2
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
    log = server.stderr()
    # one line per request, and the body cut at --max-log-len's 30 characters
    assert "POST /v1/completions 200" in log and 'body: {"model": "tiny-alias", "promp\n' in log, log[-3000:]
