"""R9: `TokenizerRegistry.register("mode", ...)`, chosen by `tokenizer_mode`, read in the frontend.

Registrations are process-global, so every mode registered here has a unique name.
"""

from __future__ import annotations

import itertools

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.frontend.tokenizer import HFAutoTokenizer, load_tokenizer, tokenizer_class
from asyncengine.plugins_api import TokenizerRegistry
from asyncengine.interfaces.tables import all_registries

_modes = (f"ae-test-bytes-{n}" for n in itertools.count())
OFFSET = 3  # ids 0..2 are special, as in many byte-level tokenizers


class ByteTokenizer:
    """A byte-level tokenizer: the minimum the engine needs (encode, decode) plus from_pretrained."""

    instances: list[ByteTokenizer] = []

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_pretrained(cls, path: str) -> ByteTokenizer:
        tokenizer = cls(path)
        cls.instances.append(tokenizer)
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [byte + OFFSET for byte in text.encode("utf-8")]

    def decode(self, token_ids, skip_special_tokens: bool = True, **kwargs) -> str:
        # The model's vocabulary (997) is larger than ours: fold the extra ids onto bytes.
        data = bytes((token_id - OFFSET) % 256 for token_id in token_ids if token_id >= OFFSET)
        return data.decode("utf-8", errors="replace")


class NoDecode:
    @classmethod
    def from_pretrained(cls, path: str) -> NoDecode:
        return cls()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1]


def test_the_field_defaults_to_auto_and_must_be_a_name():
    assert EngineConfig().tokenizer_mode == "auto"
    assert tokenizer_class("auto") is HFAutoTokenizer
    with pytest.raises(ConfigError, match="tokenizer_mode must name") as caught:
        EngineConfig(tokenizer_mode="")
    assert caught.value.field == "tokenizer_mode"


def test_the_registry_is_read_in_the_frontend_only():
    registry, readers = all_registries()["tokenizers"]
    assert registry is TokenizerRegistry and readers == frozenset({"frontend"})


def test_an_unknown_mode_lists_the_known_ones():
    mode = next(_modes)
    TokenizerRegistry.register(mode, ByteTokenizer)
    with pytest.raises(ConfigError, match=r"tokenizer_mode 'nope' names no tokenizer; known: .*\bauto\b") as caught:
        tokenizer_class("nope")
    assert mode in str(caught.value) and caught.value.field == "tokenizer_mode"


def test_a_lazy_path_is_imported_and_a_tokenizer_must_have_encode_and_decode(tmp_path):
    mode = next(_modes)
    TokenizerRegistry.register(mode, f"{__name__}:ByteTokenizer")
    assert tokenizer_class(mode) is ByteTokenizer
    assert isinstance(load_tokenizer(tmp_path, mode), ByteTokenizer)
    broken = next(_modes)
    TokenizerRegistry.register(broken, NoDecode)
    with pytest.raises(ConfigError, match=r"NoDecode.from_pretrained returned NoDecode, which has no decode method"):
        load_tokenizer(tmp_path, broken)
    missing = next(_modes)
    TokenizerRegistry.register(missing, "no_such_module_ae:Tok")
    with pytest.raises(ConfigError, match=r"tokenizer mode .*: importing 'no_such_module_ae' failed"):
        tokenizer_class(missing)


def test_an_unknown_mode_fails_the_engine_start(tiny_model):
    with pytest.raises(ConfigError, match="tokenizer_mode 'not-a-mode' names no tokenizer; known: "):
        LLM(str(tiny_model("llama").path), tokenizer_mode="not-a-mode", max_model_len=128,
            kv_cache_memory_bytes=2**20)


def test_an_in_process_engine_serves_text_with_a_registered_tokenizer(tiny_model):
    mode = next(_modes)
    TokenizerRegistry.register(mode, ByteTokenizer)
    ByteTokenizer.instances.clear()
    model = str(tiny_model("llama").path)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(model, tokenizer_mode=mode, max_model_len=128, kv_cache_memory_bytes=2**20) as llm:
        assert isinstance(llm.get_tokenizer(), ByteTokenizer)
        (output,) = llm.generate(["hi!"], params)
    assert ByteTokenizer.instances[-1].path == model
    assert output.prompt_token_ids == [ord(c) + OFFSET for c in "hi!"]
    assert len(output.outputs[0].token_ids) == 5
    # The streaming detokenizer holds back a trailing incomplete character ("\ufffd"), as vLLM's does.
    assert output.outputs[0].text == ByteTokenizer(model).decode(output.outputs[0].token_ids).rstrip("\ufffd")
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("héllo")) == "héllo"
