"""With a reasoning parser (structured_outputs_config's reasoning_parser): the constraint starts after the
reasoning ends, and the parser is read in the engine core (structured_output/reasoning.py).

- the think parser finds `</think>` in token ids, after the last `<think>`, in a prompt or an output;
- in a whole engine on the tiny Llama (random weights, byte tokenizer): the tokens before the reasoning
  ends are the model's own (those of an unconstrained run), the rest match the grammar; with
  enable_in_reasoning the whole output does;
- an unknown parser fails the engine core's start naming the config; one without is_reasoning_end is logged and
  constrains the reasoning too.
"""

from __future__ import annotations

import logging

import re
import shutil

import anyio
import pytest

from asyncengine import AsyncEngine, EngineConfig, SamplingParams, StructuredOutputsParams
from asyncengine.config.structured_outputs import with_reasoning_parser
from asyncengine.errors import ConfigError
from asyncengine.interfaces.parsers import ReasoningParser, ReasoningParserManager
from asyncengine.server.parsers.reasoning_parsers import ThinkReasoningParser
from asyncengine.structured_output.manager import StructuredOutputManager
from asyncengine.structured_output.reasoning import ReasoningGate
from support.tiny_tokenizer import save_tiny_tokenizer

# A small KV cache: the engine core builds its blocks on the event loop (fewer blocks, a shorter step)
OPTIONS = dict(max_model_len=256, kv_cache_memory_bytes=2**20, plugins="")
REASONING_TOKENS = 5


class EndsAfterFiveTokens(ReasoningParser):
    """Reasoning that ends with the fifth output token (asked first about the prompt, then after each token)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.calls = 0

    def is_reasoning_end(self, token_ids):
        self.calls += 1
        return self.calls > REASONING_TOKENS


class WithoutTokenEnd(ReasoningParser):
    pass


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("so-reasoning") / "model"
    shutil.copytree(tiny_model("llama").path, directory)
    save_tiny_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module", autouse=True)
def test_parsers():
    # Taken out again afterwards: a later module's engine-core process would otherwise find them in this
    # process's manifest and fail its start-up, rightly, for lacking them.
    before = dict(ReasoningParserManager._entries)
    ReasoningParserManager.register_module("ends_after_five_test", module=EndsAfterFiveTokens, force=True)
    ReasoningParserManager.register_module("without_token_end_test", module=WithoutTokenEnd, force=True)
    yield
    ReasoningParserManager._entries = before


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text, ended", [
    ("<think>let me see</think>The answer", True),
    ("let me see</think>", True),  # the template opened the reasoning in the prompt
    ("<think>let me see", False),
    ("no tags at all", False),
    ("<think></think>old answer<|im_end|>\n<|im_start|>assistant\n<think>\n", False),  # a new reasoning opened
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # thinking turned off by the template
])
def test_the_think_parser_finds_the_end_of_reasoning_in_token_ids(tokenizer, text, ended):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ThinkReasoningParser(tokenizer).is_reasoning_end(ids) is ended


def test_the_gate_asks_about_the_prompt_then_each_token(tokenizer):
    gate = ReasoningGate(ThinkReasoningParser)
    gate.start("closed", tokenizer, tokenizer.encode("assistant\n<think>\n\n</think>\n\n"))
    gate.start("open", tokenizer, tokenizer.encode("assistant\n<think>\n"))
    assert not gate.is_reasoning("closed") and gate.is_reasoning("open")
    for token in tokenizer.encode("hmm, 7</think"):
        gate.advance("open", token)
    assert gate.is_reasoning("open")
    gate.advance("open", tokenizer.encode(">")[0])
    assert not gate.is_reasoning("open")


def manager(config):
    return StructuredOutputManager(tokenizer_dir=None, vocab_size=1000, eos_token_ids=[2],
                                   structured_outputs_config=config)


def test_a_parser_the_engine_core_cannot_use(caplog):
    # without is_reasoning_end: constraints cover the reasoning (the behaviour before the gate), said once
    with caplog.at_level(logging.WARNING):
        assert manager({"reasoning_parser": "without_token_end_test"}).reasoning is None
    assert "is_reasoning_end" in caplog.text and "without_token_end_test" in caplog.text
    with pytest.raises(ConfigError) as refused:
        manager({"reasoning_parser": "no_such_parser"})
    assert "no_such_parser" in str(refused.value) and "'think'" in str(refused.value)
    # the reasoning constrained too: the parser is not asked at all
    assert manager({"reasoning_parser": "without_token_end_test", "enable_in_reasoning": True}).reasoning is None
    with pytest.raises(ConfigError):
        manager({"reasoning_parser": "think", "enable_in_reasoning": "yes"})


def test_serve_passes_its_reasoning_parser_unless_the_config_names_one():
    assert with_reasoning_parser(None, "think") == {"reasoning_parser": "think"}
    assert with_reasoning_parser({"backend": "guidance"}, "think") == {"backend": "guidance", "reasoning_parser": "think"}
    assert with_reasoning_parser({"reasoning_parser": "mine"}, "think") == {"reasoning_parser": "mine"}
    assert with_reasoning_parser({"backend": "guidance"}, None) == {"backend": "guidance"}


async def generate(model_dir, config, params):
    async with AsyncEngine.start(EngineConfig(model=model_dir, structured_outputs_config=config, **OPTIONS)) as engine:
        with anyio.fail_after(300):
            outputs = []
            for p in params:
                token_ids, finish = [], None
                async for out in engine.generate("Think, then give three digits", p):  # deltas
                    token_ids += out.outputs[0].token_ids
                    finish = out.outputs[0].finish_reason or finish
                outputs.append((token_ids, finish))
            return outputs


@pytest.mark.anyio
async def test_the_constraint_starts_when_the_reasoning_ends(model_dir, tokenizer):
    # Bytes only (the random model likes ids past the byte tokenizer's), EOS pushed down but allowed: the
    # model never ends while it reasons, and the grammar can still end with EOS (then the only token allowed).
    controls = dict(temperature=0, allowed_token_ids=list(range(2, 259)), logit_bias={2: -100})
    digits = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"), **controls)
    free = SamplingParams(max_tokens=REASONING_TOKENS, **controls)
    (tokens, finish), (unconstrained, _) = await generate(model_dir, {"reasoning_parser": "ends_after_five_test"},
                                                          [digits, free])
    assert tokens[:REASONING_TOKENS] == unconstrained, (tokens, unconstrained)
    assert not re.fullmatch("[0-9]*", tokenizer.decode(unconstrained))  # the model alone writes no digits here
    # then three digits and the EOS that completes the grammar
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(tokens[REASONING_TOKENS:], skip_special_tokens=True)), tokens
    assert finish == "stop" and len(tokens) == REASONING_TOKENS + 4, tokens
    [(whole, finish)] = await generate(model_dir, {"reasoning_parser": "ends_after_five_test",
                                                   "enable_in_reasoning": True}, [digits])
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(whole, skip_special_tokens=True)) and finish == "stop", whole
