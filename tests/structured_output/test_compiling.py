"""The engine core's grammar compiles, in-process with a scripted backend (tests/support/scripted_grammars.py):

- the compiled-grammar cache stays within its byte budget, least recently used out;
- a large source compiles first in the grammar-compile process: past the time limit the process is killed and the
  request refused; when every request waiting for a compile leaves, the process is killed and nothing is cached,
  and the next compile (a new process) works; what compiled there is charged what it measured;
- a grammar whose first mask allows no token is refused; a dead end, or a token outside the grammar, mid-generation
  ends the request with GrammarBroken; a small source past the time limit is refused too;
- the frontend's bounds on a constraint's source name the field and the option.

The real thing (xgrammar, the 180,000-word regex, the server's /metrics) is tests/server/test_structured_output_bounds.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from asyncengine import EngineConfig, RequestError
from asyncengine.structured_output.backend import GrammarBroken, GrammarError
from asyncengine.structured_output.cache import LRUCache
from asyncengine.structured_output.compiling import INLINE_COMPILE_BYTES
from asyncengine.structured_output.limits import MAX_SCHEMA_DEPTH, SourceLimits
from asyncengine.structured_output.manager import StructuredOutputManager
from asyncengine.structured_output_spec import GrammarSpec, StructuredOutputsParams
from support.scripted_grammars import ScriptedBackend, script
from support.tiny_tokenizer import save_tiny_tokenizer

TESTS_DIR = str(Path(__file__).resolve().parents[1])
EOS = 2
LARGE = INLINE_COMPILE_BYTES + 1  # pad: over the inline limit, so compiled in the grammar-compile process first


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("scripted-tokenizer")
    save_tiny_tokenizer(directory)
    return str(directory)


@pytest.fixture
def tests_on_child_path(monkeypatch):
    """The grammar-compile process imports the scripted backend from tests/support."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))


def manager(tokenizer_dir, *, cache_bytes=64 * 2**20, compile_timeout=30.0):
    grammars = StructuredOutputManager(tokenizer_dir=tokenizer_dir, vocab_size=300, eos_token_ids=[EOS],
                                       structured_outputs_config=None, cache_bytes=cache_bytes,
                                       compile_timeout=compile_timeout)
    grammars._backends["xgrammar"] = ScriptedBackend(None, 300, [EOS])  # the default backend's name, scripted
    return grammars


def grammar(text: str) -> GrammarSpec:
    return StructuredOutputsParams(grammar=text).to_spec()


async def prepare(grammars, request_id, text):
    grammars.track(request_id)
    await grammars.prepare(request_id, grammar(text))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_cache_keeps_within_its_budget_least_recently_used_out():
    cache = LRUCache(100)
    assert cache.put("a", "A", 40) == (True, []) and cache.put("b", "B", 40) == (True, [])
    assert cache.get("a") == "A"  # now b is the least recently used
    assert cache.put("c", "C", 40) == (True, ["B"])
    assert "b" not in cache and cache.size == 80 and len(cache) == 2 and cache.num_evicted == 1
    assert cache.put("huge", "H", 101) == (False, [])  # larger than the whole budget: not kept
    assert cache.put("a", "A2", 100) == (True, ["A", "C"]) and cache.size == 100 and cache.get("a") == "A2"


@pytest.mark.anyio
async def test_inline_grammars_are_charged_and_evicted_within_the_budget(tokenizer_dir):
    grammars = manager(tokenizer_dir, cache_bytes=3 * 2**20)  # each scripted grammar holds about 1 MiB
    async with anyio.create_task_group() as tg:
        await tg.start(grammars.serve)
        for index in range(8):
            await prepare(grammars, f"r{index}", script(tokens=(index,)))
            grammars.remove(f"r{index}")
            assert grammars.cache_bytes <= 3 * 2**20
        tg.cancel_scope.cancel()
    stats = grammars.stats_dict()
    assert stats["num_compiled"] == 8 and stats["cache_entries"] == 2 and stats["num_evicted"] == 6, stats
    assert 2 * 2**20 <= stats["cache_bytes"] <= 3 * 2**20 and stats["compile_process_starts"] == 0, stats


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"], indirect=True)  # processes: one event loop is enough
async def test_a_large_compile_runs_in_the_compile_process_which_is_killed_at_the_limit_or_when_abandoned(
        tokenizer_dir, tests_on_child_path):
    grammars = manager(tokenizer_dir, compile_timeout=2.0)
    process = grammars.compilations.process
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(grammars.serve)
            # Compiled there (measured), then here: charged the larger of what each measured.
            await prepare(grammars, "ok", script(busy=0.1, tokens=(7,), pad=LARGE))
            first_pid = process.pid
            assert first_pid is not None and grammars.cache_entries == 1 and grammars.cache_bytes >= 2**20
            # Past the time limit: refused, naming the limit; the process is killed.
            started = time.monotonic()
            with pytest.raises(GrammarError) as refused:
                await prepare(grammars, "slow", script(busy=600, pad=LARGE))
            assert 2.0 <= time.monotonic() - started < 60
            assert "longer than 2 s" in refused.value.message and "structured_outputs_compile_timeout" in refused.value.message
            assert refused.value.field == "structured_outputs.grammar"
            assert process.pid is None and not os.path.exists(f"/proc/{first_pid}")
            # Every request waiting for a compile leaves: the process is killed, nothing cached.
            tg.start_soon(prepare, grammars, "abandoned-1", script(busy=600, tokens=(9,), pad=LARGE))
            tg.start_soon(prepare, grammars, "abandoned-2", script(busy=600, tokens=(9,), pad=LARGE))
            while not process.compiling:
                await anyio.sleep(0.05)
            busy_pid = process.pid
            grammars.remove("abandoned-1")
            await anyio.sleep(0.5)
            assert process.pid == busy_pid  # another request still waits for it
            grammars.remove("abandoned-2")
            with anyio.fail_after(10):
                while os.path.exists(f"/proc/{busy_pid}"):
                    await anyio.sleep(0.05)
            # A new process for the next compile; the cache holds only the first grammar.
            await prepare(grammars, "after", script(busy=0.1, tokens=(8,), pad=LARGE))
            assert process.pid not in (None, first_pid, busy_pid)
            idle_pid = process.pid
            before = cpu_seconds(idle_pid)
            await anyio.sleep(1.0)
            assert cpu_seconds(idle_pid) - before < 0.2  # idle between compiles
            tg.cancel_scope.cancel()
    stats = grammars.stats_dict()
    assert stats["num_isolated_compiles"] == 2 and stats["num_timeouts"] == 1, stats
    assert stats["num_compiles_cancelled"] == 1 and stats["cache_entries"] == 2, stats
    assert stats["compile_process_starts"] == 3 and stats["compile_process_kills"] == 2, stats
    assert not os.path.exists(f"/proc/{idle_pid}")  # the engine core's step loop ended: so did the process


@pytest.mark.anyio
async def test_a_grammar_that_cannot_go_on_is_an_error_never_unconstrained(tokenizer_dir):
    grammars = manager(tokenizer_dir, compile_timeout=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(grammars.serve)
        with pytest.raises(GrammarError) as refused:  # nothing allowed at the first step (not even the EOS)
            await prepare(grammars, "empty", script(tokens=(), end=False))
        assert "allows no token at its start" in refused.value.message
        assert refused.value.field == "structured_outputs.grammar"
        # A dead end after one token: the next token (whatever the worker made of a mask allowing none) fails it.
        await prepare(grammars, "dead", script(tokens=(5,), end=False))
        assert grammars.bitmask(["dead"]) is not None and grammars.accept("dead", 5) is False
        grammars.bitmask(["dead"])
        with pytest.raises(GrammarBroken) as broken:
            grammars.accept("dead", 0)
        assert broken.value.field == "structured_outputs.grammar" and "allows no token after the 1 tokens" in str(broken.value)
        # A token outside the mask (something after the mask refused all it allowed): an error too.
        await prepare(grammars, "outside", script(tokens=(5, 6)))
        grammars.bitmask(["outside"])
        with pytest.raises(GrammarBroken) as broken:
            grammars.accept("outside", 9)
        assert "token 9, sampled after 0 tokens, is outside the grammar" in str(broken.value)
        # Complete: the EOS ends it.
        await prepare(grammars, "fine", script(tokens=(5,)))
        assert grammars.accept("fine", 5) is False and grammars.accept("fine", EOS) is True
        # A small source compiles here, in a thread: past the limit the request is refused all the same.
        with pytest.raises(GrammarError) as refused:
            await prepare(grammars, "slow", script(busy=3.0))
        assert "longer than 0.5 s" in refused.value.message
        tg.cancel_scope.cancel()
    assert grammars.stats.num_timeouts == 1 and grammars.compilations.process.num_started == 0


def test_the_frontend_bounds_a_constraints_source_naming_the_field_and_option():
    limits = SourceLimits.of(EngineConfig(structured_outputs_max_schema_bytes=100,
                                          structured_outputs_max_regex_bytes=10,
                                          structured_outputs_max_grammar_bytes=20))
    cases = [
        (StructuredOutputsParams(regex="a" * 11), "structured_outputs.regex", "structured_outputs_max_regex_bytes"),
        (StructuredOutputsParams(choice=["a" * 20]), "structured_outputs.choice", "structured_outputs_max_grammar_bytes"),
        (StructuredOutputsParams(grammar="x" * 21), "structured_outputs.grammar", "structured_outputs_max_grammar_bytes"),
        (StructuredOutputsParams(json={"enum": ["a" * 100]}), "structured_outputs.json",
         "structured_outputs_max_schema_bytes"),
        (StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" " * 11),
         "structured_outputs.whitespace_pattern", "structured_outputs_max_regex_bytes"),
    ]
    for params, field, option in cases:
        with pytest.raises(RequestError) as refused:
            limits.check(params.to_spec())
        assert refused.value.field == field and option in refused.value.message, refused.value.message
        assert refused.value.code == "string_above_max_length"
    limits.check(StructuredOutputsParams(regex="a" * 10).to_spec())  # at the limit: fine
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(RequestError) as refused:
        SourceLimits.of(EngineConfig()).check(StructuredOutputsParams(json=deep).to_spec())
    assert f"over the limit of {MAX_SCHEMA_DEPTH}" in refused.value.message
    with pytest.raises(RequestError) as refused:  # past what Python's json reads at all: a 400, not a 500
        StructuredOutputsParams(json='{"a":' * 5000 + "1" + "}" * 5000).to_spec()
    assert refused.value.field == "structured_outputs.json"
