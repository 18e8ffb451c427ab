"""The start-up summary `serve` logs at INFO between the command and the address it serves on, as vLLM
logs its own: the model (architecture, dtype, device, weights' memory, load time), the KV cache (blocks,
tokens, bytes, the maximum concurrency at max_model_len) and a speculative draft's beside it, the C kernels
built or loaded from cache, the plugins loaded, and each process's start-up phases with their time.

It reads the start-up report (the records every process sent in the hand-shake, GET /v1/startup), so it
says the same for an engine core in its own process as in this one. Progress lines (a C kernel build
that takes a minute) are logged where the work happens, as it happens; this is the summary after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from asyncengine.interfaces.spec_decode import PROPOSER_KV_CACHE
from asyncengine.wire.startup import StartupRecord

logger = logging.getLogger("asyncengine.startup")

# The plugin field of the records the workers write about what they built (worker/model_runner.py).
MODEL_WEIGHTS, KV_CACHE, KERNELS_PREFIX = "model weights", "KV cache", "C kernels "


def startup_summary(model: str, records: Iterable[StartupRecord]) -> list[str]:
    """The summary's lines, in order (`model`: what the user asked for)."""
    records = list(records)
    roles = {record.role for record in records if record.plugin in (MODEL_WEIGHTS, KV_CACHE)}
    where = (lambda record: f"{record.role}: ") if len(roles) > 1 else (lambda record: "")
    lines = [f"{where(r)}model {model}: {r.reason}" for r in records if r.plugin == MODEL_WEIGHTS]
    lines += [f"{where(r)}KV cache: {r.reason}" for r in records if r.plugin == KV_CACHE]
    lines += [f"{where(r)}speculative proposer: {r.reason}" for r in records if r.plugin == PROPOSER_KV_CACHE]
    kernels = [_kernel(r) for r in records if (r.plugin or "").startswith(KERNELS_PREFIX)]
    if kernels:
        lines.append("C kernels: " + ", ".join(dict.fromkeys(kernels)))  # each rank builds the same: once
    plugins = [r for r in records if r.group is not None and r.plugin is not None]
    if plugins:
        loaded = sorted({r.plugin for r in plugins if r.outcome == "ok" and r.plugin is not None})
        others = len({(r.group, r.plugin) for r in plugins if r.outcome != "ok"})
        lines.append(f"plugins: {len(loaded)} loaded" + (f" ({', '.join(loaded)})" if loaded else "")
                     + (f", {others} skipped or failed (asyncengine plugins timeline)" if others else ""))
    phases: dict[str, list[str]] = {}
    for record in records:
        if record.plugin is None and record.group is None:
            phases.setdefault(record.role, []).append(f"{record.phase} {record.duration:.2f} s")
    for role, timings in phases.items():
        lines.append(f"start-up phases of the {role}: {', '.join(timings)}")
    return lines


def _kernel(record: StartupRecord) -> str:
    name = (record.plugin or "").removeprefix(KERNELS_PREFIX)
    outcome = (record.reason or "").split(":", 1)[0]
    if outcome == "compiled":
        return f"{name} compiled in {record.duration:.1f} s"
    if outcome == "cached":
        return f"{name} loaded from cache"
    return f"{name} unavailable (its layers use torch: {(record.reason or '').split(': ', 1)[-1]})"


def log_startup_summary(model: str, records: Iterable[StartupRecord]) -> None:
    for line in startup_summary(model, records):
        logger.info("%s", line)
