"""`asyncengine plugins check --deep`: a real start on a tiny model, so that a plugin's worker, platform and
quantization code runs where serving would run it.

The plain check stops each process after its plugin phases; a worker class whose `init_device` raises, or a
quantization method whose `create_weights` does, passes it. The deep check starts the engine as `serve` would
(the platform, the engine core, one worker per rank on the configured executor) on a tiny Llama config
written to a temporary folder with `load_format="dummy"` (random weights; no checkpoint, no tokenizer),
builds the model (with `--quantization`, through that method), runs one forward (a one-token generation)
and stops. The first failure is reported with its phase, process, plugin and hook, read from the error that
the start-up phases and `plugin_hook` (interfaces/plugin_code.py) composed, in whichever process it began.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
import msgspec

from asyncengine.config.engine import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.plugin_runtime.records import FAILED, StartupTrace, read_trace
from asyncengine.wire.startup import StartupRecord

# The smallest Llama our loader builds: two layers (so a pipeline or a rank split has something to split),
# 4 query and 2 KV heads (divisible at TP=2), 256 tokens. Random weights: load_format "dummy".
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
PROMPT = [1, 5, 7, 11]
KV_CACHE_BYTES = 1 << 20  # a few blocks of the tiny model: the check allocates, it does not serve


@dataclass(frozen=True)
class Culprit:
    """Where the first failure began, as far as its message says (it crossed processes as text)."""

    phase: str | None
    process: str | None
    plugin: str | None
    hook: str | None
    message: str


# "the worker rank 0 (pid 42) failed in start-up phase 'load model': ..." (plugin_runtime/records.py) and
# "plugin code pkg.Cls (distribution d 1.0): its hook init_device raised ... (in the worker rank 0 (pid 42))"
# (interfaces/plugin_code.py): the innermost phase and the plugin's own naming.
_PHASE = re.compile(r"(the [^()]+? \(pid \d+\)) failed in start-up phase '([^']+)'")
_PLUGIN = re.compile(r"plugin code (\S+ \([^)]*\)): its hook (\S+) raised .*\(in (the [^()]+? \(pid \d+\))\)",
                     re.DOTALL)


def culprit_of(error: BaseException, records: list[StartupRecord]) -> Culprit:
    """From the error's message; the phase, when the message does not say it (an error naming its plugin
    passes the phases unchanged), from the failed record of the process it names."""
    message = str(error)
    phases = _PHASE.findall(message)
    plugin = _PLUGIN.search(message)
    process, phase = phases[-1] if phases else (None, None)
    if plugin:
        process = plugin.group(3)
    if phase is None:
        failed = [r for r in records if r.outcome == FAILED and (process is None or f"(pid {r.pid})" in process)]
        phase = failed[0].phase if failed else None
    return Culprit(phase=phase, process=process, plugin=plugin.group(1) if plugin else None,
                   hook=plugin.group(2) if plugin else None, message=message)


def write_tiny_llama(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


async def deep_check(config: EngineConfig) -> tuple[list[StartupRecord], Culprit | None]:
    """Start, build the tiny model, one forward, stop: (every process's records, the first failure or None).
    Unusable options raise ConfigError (the CLI's exit code 2), as in the plain check."""
    from asyncengine.frontend.async_engine import AsyncEngine
    from asyncengine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory(prefix="asyncengine-deep-check-") as scratch:
        model_dir = write_tiny_llama(Path(scratch) / "tiny-llama")
        trace_file = Path(scratch) / "startup-trace.json"
        checked = msgspec.structs.replace(
            config, model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, max_model_len=64,
            kv_cache_memory_bytes=KV_CACHE_BYTES, startup_trace=str(trace_file))
        trace = StartupTrace("frontend")
        failure: Exception | None = None
        started = time.time()
        try:
            async with AsyncEngine.start(checked) as engine:
                forward_started = time.time()
                tokens: list[int] = []
                async for output in engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1)):
                    tokens.extend(output.outputs[0].token_ids)
                if len(tokens) != 1:  # our own engine's fault, not a plugin's: said plainly
                    raise RuntimeError(f"one forward on the tiny model gave {len(tokens)} tokens, not one")
                trace.add("deep check: one forward", started=forward_started)
        except ConfigError as error:
            if getattr(error, "plugin_hook", None) is None:
                raise  # the options themselves: the CLI's exit code 2
            failure = error  # a plugin refusing the configuration: its finding, named
        except Exception as error:  # any failure is the check's finding: reported with its culprit, exit 1
            failure = error
            if not trace_file.is_file():  # failed before the start-up trace was written
                trace.add("deep check: start", started=started, outcome=FAILED, reason=str(error))
        records = (read_trace(trace_file) if trace_file.is_file() else []) + trace.records
        return records, None if failure is None else culprit_of(failure, records)


def format_culprit(culprit: Culprit) -> str:
    not_plugin = "(none: not raised from plugin code)"
    return "\n".join([
        "deep check failed:",
        f"  plugin:  {culprit.plugin or not_plugin}",
        f"  hook:    {culprit.hook or not_plugin}",
        f"  process: {culprit.process or '(not named)'}",
        f"  phase:   {culprit.phase or '(after start-up)'}",
        f"  error:   {culprit.message}",
    ])


def unbuilt_quantization_methods(config: EngineConfig) -> list[str]:
    """Plugin-registered quantization methods this check did not build (only `--quantization` is built)."""
    from asyncengine.interfaces.quantization import QuantizationRegistry
    from asyncengine.interfaces.registry import BUILT_IN

    return [name for name, owner in QuantizationRegistry.owners().items()
            if owner != BUILT_IN and name != config.quantization]


__all__ = ["Culprit", "TINY_LLAMA", "culprit_of", "deep_check", "format_culprit", "unbuilt_quantization_methods",
           "write_tiny_llama"]
