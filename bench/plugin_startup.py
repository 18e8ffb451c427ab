"""Start-up cost of the plugin phases with 10 trivial plugins installed, per process.

    python bench/plugin_startup.py              # 10 plugins, TP=2 (four processes), 5 runs each way
    python bench/plugin_startup.py --runs 3 --tp 1

It builds 10 trivial plugin distributions (each a general plugin that registers one model
architecture, so the manifest check has 10 more keys to compare), installs them into a temporary
target put on PYTHONPATH (never into .venv), and runs `asyncengine plugins check --startup-trace`
(a real start of every role, without a model) alternately without and with them. From each
process's records it sums the plugin phases (entry-point discovery, platform, general plugins, role
groups, config hooks, manifest check) and subtracts the time spent importing the plugins' modules
(each load record carries it), which is the plugin's own cost, not the runtime's.

Figures per process: the median over the runs of the plugin phases without plugins, with them, the
imports, and the overhead beyond imports (with, minus imports). Goal: under 50 ms per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_PHASES = ("platform", "general plugins", "role groups", "config hooks", "manifest check")

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "ae-bench-plugin-{n:02d}"
version = "0.1.0"

[project.entry-points."asyncengine.general_plugins"]
bench_{n:02d} = "ae_bench_plugin_{n:02d}:register"

[tool.setuptools]
py-modules = ["ae_bench_plugin_{n:02d}"]
"""

MODULE = '''from asyncengine.plugins_api import ModelRegistry


def register():
    ModelRegistry.register_model("Bench{n:02d}ForCausalLM", "asyncengine.models.llama:LlamaForCausalLM")
'''


def build_plugins(root: Path, count: int) -> Path:
    sources = []
    for n in range(count):
        source = root / "src" / f"ae-bench-plugin-{n:02d}"
        source.mkdir(parents=True)
        (source / "pyproject.toml").write_text(PYPROJECT.format(n=n))
        (source / f"ae_bench_plugin_{n:02d}.py").write_text(MODULE.format(n=n))
        sources.append(str(source))
    target = root / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), *sources], check=True)
    return target


def one_start(env: dict[str, str], trace_file: Path, tp: int) -> dict[str, dict[str, float]]:
    """Per process role: the plugin phases' seconds, and the plugins' import seconds."""
    result = subprocess.run(
        [sys.executable, "-m", "asyncengine", "plugins", "check", "--tp", str(tp), "--startup-trace", str(trace_file)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        raise SystemExit(f"plugins check failed:\n{result.stdout}\n{result.stderr}")
    records = json.loads(trace_file.read_text())
    per_role: dict[str, dict[str, float]] = {}
    for record in records:
        figures = per_role.setdefault(record["role"], {"phases": 0.0, "imports": 0.0, "plugins": 0})
        if record["plugin"] is None and record["phase"] in PLUGIN_PHASES:
            figures["phases"] += record["duration"]
        elif record["plugin"] == "entry points":  # discovery runs just before the platform phase
            figures["phases"] += record["duration"]
        elif record["group"] is not None and record["outcome"] == "ok":
            figures["imports"] += record["import_duration"]
            figures["plugins"] += 1
    return per_role


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugins", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ae-bench-plugins-") as tmp:
        root = Path(tmp)
        target = build_plugins(root, args.plugins)
        base = {k: v for k, v in os.environ.items() if k not in ("ASYNCENGINE_PLUGINS", "PYTHONPATH")}
        base["PYTHONPATH"] = str(ROOT)
        envs = {"without": base, "with": {**base, "PYTHONPATH": f"{target}{os.pathsep}{ROOT}"}}
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        one_start(envs["with"], root / "warm.json", args.tp)  # warm the file cache once
        for index in range(args.runs):
            for label, env in envs.items():
                runs[label].append(one_start(env, root / f"{label}-{index}.json", args.tp))

    roles = list(runs["with"][0])
    print(f"{args.plugins} trivial general plugins, `plugins check --tp {args.tp}`, median of {args.runs} runs (ms)")
    print(f"{'process':<16}{'without':>10}{'with':>10}{'imports':>10}{'beyond imports':>16}{'plugins':>9}")
    summary = {}
    for role in roles:
        without = statistics.median(run[role]["phases"] for run in runs["without"]) * 1000
        with_ = statistics.median(run[role]["phases"] for run in runs["with"]) * 1000
        imports = statistics.median(run[role]["imports"] for run in runs["with"]) * 1000
        beyond = statistics.median((run[role]["phases"] - run[role]["imports"]) for run in runs["with"]) * 1000
        loaded = runs["with"][0][role]["plugins"]
        summary[role] = dict(without_ms=without, with_ms=with_, imports_ms=imports, beyond_imports_ms=beyond,
                             plugins_loaded=loaded)
        print(f"{role:<16}{without:>10.1f}{with_:>10.1f}{imports:>10.1f}{beyond:>16.1f}{loaded:>9}")
    worst = max(figures["beyond_imports_ms"] for figures in summary.values())
    print(f"worst process: {worst:.1f} ms beyond imports (goal: under 50 ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"plugins": args.plugins, "runs": args.runs, "tp": args.tp,
                                               "per_process": summary}, indent=2))


if __name__ == "__main__":
    main()
