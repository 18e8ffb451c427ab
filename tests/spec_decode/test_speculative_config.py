"""speculative_config: vLLM's JSON shape parsed, checked with errors that say what to do; the flag's JSON; the
draft-vocabulary check; the proposer registry's name checks."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from asyncengine.cli.args import add_engine_arguments, engine_config_from_args
from asyncengine.config.draft_vocabulary import Vocabulary, check_draft_vocabulary, tokenizer_digest
from asyncengine.config.engine import config_from_dict
from asyncengine.config.speculative import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    check_against_engine,
    parse_speculative_config,
)
from asyncengine.errors import ConfigError
from asyncengine.interfaces.registry import RegistrationError
from asyncengine.interfaces.spec_decode import DraftTokens, ProposalBatch, Proposer, ProposerRegistry


def refused(value: Any, *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_speculative_config(value)
    assert info.value.field == "speculative_config"
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_vllm_shapes_parse():
    assert parse_speculative_config(None) is None
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max,
            ngram.model) == ("ngram", 4, 5, 5, None)  # vLLM's defaults: 5 and 5
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
                                    ).prompt_lookup_max == 2  # one bound given: the other takes its value
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    draft = parse_speculative_config({"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3,
                                      "draft_tensor_parallel_size": 1})
    assert draft.uses_draft_model and draft.model == "/m/draft" and draft.draft_tensor_parallel_size == 1
    # vLLM infers the method from the model when it is left out.
    assert parse_speculative_config({"model": "/m/qwen-0.5b", "num_speculative_tokens": 3}).method == "draft_model"
    assert parse_speculative_config({"model": "/m/EAGLE3-LLaMA3.1", "num_speculative_tokens": 3}).method == "eagle3"
    assert parse_speculative_config({"model": "/m/EAGLE-LLaMA3", "num_speculative_tokens": 3}).method == "eagle"
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}).model is None
    plugin = parse_speculative_config({"method": "my_lookup", "num_speculative_tokens": 2, "prompt_lookup_max": 9})
    assert plugin.prompt_lookup_max == 9 and plugin.prompt_lookup_min is None


def test_refusals_name_the_problem():
    refused({"method": "ngram"}, "num_speculative_tokens is required")
    for k in (0, -1, MAX_SPECULATIVE_TOKENS + 1, 2.5, True, "4"):
        refused({"method": "ngram", "num_speculative_tokens": k}, "from 1 to 32", repr(k))
    refused({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)")
    refused({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min", "at least 1")
    for method, what in (("draft_model", "the draft model"), ("eagle", "EAGLE head"), ("eagle3", "EAGLE3 head")):
        refused({"method": method, "num_speculative_tokens": 2}, f"method {method} needs \"model\"", what)
    refused({"method": "eagle", "model": "/h", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "apply to method ngram only")
    refused({"method": "ngram", "model": "/m/draft", "num_speculative_tokens": 2}, "loads no model")
    refused({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "method ngram has none")
    refused({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 2},
            "vLLM's key 'tensor_parallel_size' is not built here", "draft_tensor_parallel_size")
    refused({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown key 'lookahead'")
    refused({"num_speculative_tokens": 2}, "needs \"method\"")
    refused({"method": "", "num_speculative_tokens": 2}, "must name a proposer")
    refused("ngram", "must be a JSON object")


def test_limits_from_the_engine():
    config = parse_speculative_config({"method": "draft_model", "model": "/d", "num_speculative_tokens": 8,
                                       "draft_tensor_parallel_size": 1})
    check_against_engine(config, tensor_parallel_size=1, max_model_len=100, max_num_batched_tokens=9)
    with pytest.raises(ConfigError, match="must be 1 or the target's tensor_parallel_size \\(4\\)"):
        check_against_engine(msgspec.structs.replace(config, draft_tensor_parallel_size=2),
                             tensor_parallel_size=4, max_model_len=100, max_num_batched_tokens=64)
    # A draft or head beside a sharded target is not built: refused, naming what runs instead.
    with pytest.raises(ConfigError, match="method draft_model runs its model .* tensor_parallel_size 1 only; this "
                                          "engine has 2"):
        check_against_engine(config, tensor_parallel_size=2, max_model_len=100, max_num_batched_tokens=64)
    check_against_engine(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 8}),
                         tensor_parallel_size=2, max_model_len=100, max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="k \\+ 1 = 9 tokens .* more than max_num_batched_tokens \\(8\\)"):
        check_against_engine(config, tensor_parallel_size=1, max_model_len=100, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="below max_model_len \\(8\\)"):
        check_against_engine(config, tensor_parallel_size=1, max_model_len=8, max_num_batched_tokens=64)


def test_the_drafts_quantization_and_dtype():
    config = parse_speculative_config({"method": "draft_model", "model": "/d.gguf", "num_speculative_tokens": 2,
                                       "quantization": "gguf"})
    assert config.quantization == "gguf"
    refused({"method": "eagle", "model": "/h", "num_speculative_tokens": 2, "quantization": "int8"},
            "quantization applies to method draft_model")
    refused({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "method ngram has none")
    refused({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2, "quantization": ""},
            "must name a quantization method")
    refused({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2, "dtype": "float16"},
            "vLLM's key 'dtype' is not built here", "the target's dtype")


def test_the_flag_takes_vllm_json():
    # The engine's own CLI flag (an EngineConfig field), as vLLM's: JSON, checked when the config is built.
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    config = engine_config_from_args(args, model=None)
    speculative = config.speculative
    assert speculative is not None
    assert (speculative.method, speculative.num_speculative_tokens, speculative.prompt_lookup_min,
            speculative.prompt_lookup_max) == ("ngram", 3, 4, 4)
    with pytest.raises(argparse.ArgumentError, match="--speculative-config takes JSON"):
        parser.parse_args(["--speculative-config", "{method: ngram}"])


def test_the_engine_option_is_checked_when_the_config_is_built():
    assert config_from_dict({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}).speculative \
        == parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert config_from_dict({}).speculative is None
    with pytest.raises(ConfigError, match="from 1 to 32") as info:
        config_from_dict({"speculative_config": {"method": "ngram", "num_speculative_tokens": 40}})
    assert info.value.field == "speculative_config"


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_draft_vocabulary():
    shared = _Tokenizer({"a": 0, "b": 1, "c": 2})
    target = Vocabulary.of(SimpleNamespace(served_model_name="target", vocab_size=8), shared)
    # Padded differently over one tokenizer (Qwen2.5's 0.5B and 7B): allowed, the common ids are the first 4.
    assert check_draft_vocabulary(target, Vocabulary.of(SimpleNamespace(served_model_name="d", vocab_size=4),
                                                        _Tokenizer({"a": 0, "b": 1, "c": 2}))) == 4
    with pytest.raises(ConfigError, match="tokenizer of 4 tokens, the target 'target' one of 3"):
        check_draft_vocabulary(target, Vocabulary.of(SimpleNamespace(served_model_name="d", vocab_size=8),
                                                     _Tokenizer({"a": 0, "b": 1, "c": 2, "d": 3})))
    with pytest.raises(ConfigError, match="their tokens have different ids"):
        check_draft_vocabulary(target, Vocabulary.of(SimpleNamespace(served_model_name="d", vocab_size=8),
                                                     _Tokenizer({"a": 0, "c": 1, "b": 2})))
    with pytest.raises(ConfigError, match="scores 2 token ids, fewer than its tokenizer's 3"):
        check_draft_vocabulary(target, Vocabulary.of(SimpleNamespace(served_model_name="d", vocab_size=2), shared))
    # Without tokenizers, only equal vocabulary sizes pass.
    assert check_draft_vocabulary(Vocabulary("t", 100), Vocabulary("d", 100)) == 100
    with pytest.raises(ConfigError, match="the draft 'd' has a vocabulary of 99 tokens, the target 't' one of 100"):
        check_draft_vocabulary(Vocabulary("t", 100), Vocabulary("d", 99))
    assert tokenizer_digest(shared) == tokenizer_digest(_Tokenizer({"c": 2, "a": 0, "b": 1}))


def test_the_registry_names_registered_and_coming_methods():
    with pytest.raises(ConfigError) as info:
        ProposerRegistry.proposer_class("suffix")
    message = str(info.value)
    assert "'suffix' is not a registered proposer; registered: draft_model, eagle, eagle3, ngram" in message
    assert "not built yet: vLLM's mtp" in message


class _ModelProposer(Proposer):
    requires_model = True

    def propose(self, batch: ProposalBatch, num_speculative_tokens: int) -> DraftTokens:
        raise NotImplementedError  # never run here: the test checks the start-up check only


def test_a_plugin_proposer_registers_and_is_checked():
    ProposerRegistry.register_proposer("test_needs_model", _ModelProposer)
    try:
        ProposerRegistry.register_proposer("test_needs_model", _ModelProposer)  # the same again: a no-op
        with pytest.raises(RegistrationError, match="already registered"):
            ProposerRegistry.register_proposer("test_needs_model", "pkg.mod:Other")
        config = parse_speculative_config({"method": "test_needs_model", "num_speculative_tokens": 2})
        with pytest.raises(ConfigError, match="needs \"model\""):
            ProposerRegistry.check_method(config)
        ProposerRegistry.check_method(SpeculativeConfig(method="test_needs_model", num_speculative_tokens=2,
                                                        model="/m"))
        with pytest.raises(RegistrationError, match="must be a subclass of Proposer"):
            ProposerRegistry.register_proposer("test_not_a_proposer", object)
        ProposerRegistry.register_proposer("test_not_a_proposer", "collections:OrderedDict")  # by path: checked when loaded
        with pytest.raises(ConfigError, match="not a subclass of Proposer"):
            ProposerRegistry.proposer_class("test_not_a_proposer")
    finally:
        ProposerRegistry._entries.pop("test_needs_model", None)
        ProposerRegistry._entries.pop("test_not_a_proposer", None)
