"""Public vLLM plugins from PyPI, ported by `asyncengine plugins port` alone: what the tool maps, and what then runs.

    python bench/port_public_plugins.py --download          # fetch the wheels (pip download --no-deps), then run
    python bench/port_public_plugins.py                     # the wheels already in the cache only
    python bench/port_public_plugins.py vllm-bnb-plugin     # some of them
    python bench/port_public_plugins.py --markdown          # the table docs/porting.md prints

Each plugin's wheel (pinned below) is unpacked into a temporary folder, as `pip install --no-deps --target` would
lay it out, and ported in place by the tool (its modules, and its `*.dist-info/entry_points.txt`, which holds its
registration). Figures per plugin, from the tool's own report:

- uses of vLLM names **mapped** by the table, **provided** by name (no row, but ours of the same name imports),
  and **missing** (the tool leaves them, listed with their line); the distinct missing names; the lines that need
  a hand change (distinct file:line with a missing use).

Then its contract layer runs in a fresh process, with nothing but the ported tree (and the stubs named below,
for hardware runtimes this machine lacks) on PYTHONPATH, and no vLLM installed:

- every module of the plugin imported (how many import; the first error of each that does not);
- each entry point in our groups loaded and called as the runtime calls it: a general plugin's function, a
  platform plugin's detector (its class then imported and its predicates asked), an IO processor's factory (its
  class imported), a logits processor's class;
- what the general plugins registered: each quantization method's vLLM class methods (`get_name`,
  `get_supported_act_dtypes`, `get_min_capability`, `get_config_filenames`), each model loader built with a
  `LoadConfig`, each model architecture resolved to its class.

No figure here is timed. Downloads need PyPI; the tests never download (they use distributions written in
tests/plugins/vllm-shaped-*).
"""

from __future__ import annotations

import argparse
import configparser
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_CACHE = Path(os.environ.get("AE_PUBLIC_PLUGINS_CACHE", "/tmp/vplug-pypi"))

# (distribution, version, what it is). Pinned: the figures in docs/porting.md are for these versions.
PLUGINS = [
    ("vllm-bnb-plugin", "0.0.3", "quantization + model loader (bitsandbytes), general plugin"),
    ("vllm-gguf-plugin", "0.0.5", "quantization + model loader (GGUF), general plugin"),
    ("vllm-df11", "0.0.1", "quantization + model loader (DFloat11), general plugin"),
    ("pace-vllm", "1.3.0", "platform (AMD PACE, CPU): platform, worker, attention, layers"),
    ("vllm-musa", "0.1.1", "platform (Moore Threads MUSA GPUs): platform, worker"),
    ("vllm-spyre", "1.10.0", "platform (IBM Spyre): platform, worker, model runner"),
    ("vllm-factory", "0.2.1", "models + IO processors (ColBERT/GLiNER poolers), general and IO-processor plugins"),
    ("vllm-sbw", "1.0.0", "logits processor (watermarking)"),
]

# Modules of a hardware runtime this machine lacks, stubbed as empty modules so that a plugin's own modules can
# be imported and its registration layer run; nothing of the plugin's own code is replaced.
STUBS: dict[str, list[str]] = {
    "vllm-musa": ["torch_musa"],
    "vllm-bnb-plugin": ["bitsandbytes", "bitsandbytes.functional"],
}


# A plugin's own dependencies that are not vLLM (pure Python), unpacked beside the stubs so that its modules import.
DEPENDENCIES: dict[str, list[tuple[str, str]]] = {"vllm-sbw": [("sbw", "1.0.0")]}

# Classes a plugin names by an option, not an entry point (`--logits-processors pkg.mod:Class`): imported, and
# checked against our interface of that kind.
CLASSES: dict[str, list[tuple[str, str]]] = {
    "vllm-sbw": [("logits_processors", "vllm_sbw.logits_processor:SBWLogitsProcessor")]}

# Changes by hand after the port, each with why: what a plugin author would change, and the figures count.
# (file, text the port left, replacement, why)
HAND_CHANGES: dict[str, list[tuple[str, str, str, str]]] = {
    "pace-vllm": [("pace_vllm/__init__.py", "    supported, vllm_version, range_spec, reason = _check_vllm_version_supported()",
                   "    supported, vllm_version, range_spec, reason = True, 'asyncengine', '', ''",
                   "its detector declines unless `import vllm` works and vllm's version is in its range")],
}


# Engine options a plugin requires (what its README tells a user to pass), for its check_and_update_config.
OPTIONS: dict[str, dict[str, object]] = {"pace-vllm": {"dtype": "bfloat16", "async_scheduling": False}}


# -- fetch and port ------------------------------------------------------------------------------------------


def wheel_path(cache: Path, name: str, version: str, *, stem: str | None = None) -> Path | None:
    folder = cache / name
    stem = (stem or name).replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version}-*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def download(cache: Path, name: str, version: str, *, folder: Path | None = None) -> None:
    folder = folder or cache / name
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--dest", str(folder), f"{name}=={version}"], check=True)


def unpack_dependencies(cache: Path, name: str, into: Path, *, fetch: bool) -> None:
    for dependency, version in DEPENDENCIES.get(name, []):
        wheel = wheel_path(cache, "deps", version, stem=dependency)
        if wheel is None and fetch:
            download(cache / "deps", dependency, version, folder=cache / "deps")
            wheel = wheel_path(cache, "deps", version, stem=dependency)
        if wheel is None:
            raise SystemExit(f"{name} needs {dependency}=={version}: not in {cache / 'deps'} (run with --download)")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(into)


def port(wheel: Path, into: Path) -> dict:
    from asyncengine.porting.project import port_tree

    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)
    report = port_tree(into)
    report.write()
    changed = []
    for relative, old, new, why in HAND_CHANGES.get(into.name, []):
        path = into / relative
        text = path.read_text(encoding="utf-8")
        if old not in text:
            raise SystemExit(f"{into.name}: the hand change to {relative} no longer applies ({why})")
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
        changed.append(f"{relative}: {why}")
    missing = [(path.relative_to(into).as_posix(), use.line, use.what) for path, result in report.results.items()
               for use in result.unmapped]
    return {
        "mapped": report.num_mapped, "provided": report.num_provided, "missing": len(missing),
        "missing_names": Counter(_name_of(what) for _, _, what in missing).most_common(),
        "hand_lines": len({(path, line) for path, line, _ in missing}),
        "provided_names": sorted({p.what for r in report.results.values() for p in r.provided}),
        "hand_changes": changed,
    }


def _name_of(what: str) -> str:
    """A missing use as a name: `vllm.x.y` as it is, a class path's string without its quotes."""
    return what.removeprefix("the class path ").strip("'")


# -- the contract layer, in a fresh process --------------------------------------------------------------------


def probe(tree: Path) -> dict:
    """Run in the child: call every entry point, ask what the general plugins registered."""
    from asyncengine.interfaces.model_loader import ModelLoaderRegistry
    from asyncengine.interfaces.models import ModelRegistry
    from asyncengine.interfaces.quantization import QuantizationRegistry

    before = {"quantization": set(QuantizationRegistry.keys()), "loaders": set(ModelLoaderRegistry.keys()),
              "models": set(ModelRegistry.keys()) if hasattr(ModelRegistry, "keys") else set()}
    out: dict = {"entry_points": [], "registered": [], "imports": {}}
    groups = configparser.ConfigParser(delimiters=("=",))
    groups.optionxform = str  # type: ignore[assignment,method-assign]
    for info in tree.glob("*.dist-info/entry_points.txt"):
        groups.read(info, encoding="utf-8")
    for group in groups.sections():
        if group == "console_scripts":
            continue
        for name, target in groups.items(group):
            out["entry_points"].append(_run_entry_point(group, name, target.strip()))
    for kind, path in json.loads(os.environ.get("AE_PROBE_CLASSES", "[]")):
        out["entry_points"].append(_run_entry_point(f"asyncengine.{kind}", "(named by an option)", path))
    for kind, registry in (("quantization", QuantizationRegistry), ("loaders", ModelLoaderRegistry)):
        for key in sorted(set(registry.keys()) - before[kind]):
            out["registered"].append(_ask_registered(kind, key))
    return out


def _failure(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "asyncengine" not in f.filename),
                 "")
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''} ({where})"


def _load(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module.strip())
    for part in attr.strip().split("."):
        if part:
            obj = getattr(obj, part)
    return obj


def _import_class_path(path: str):
    from asyncengine.interfaces.imports import import_by_path

    return import_by_path(path, what="class")


def _run_entry_point(group: str, name: str, target: str) -> dict:
    record: dict = {"group": group, "name": name, "target": target, "steps": []}
    steps = record["steps"]
    if not group.startswith("asyncengine."):
        steps.append(("in our groups", f"no: group {group} is not ours (the port left it)"))
        return record
    try:
        obj = _load(target)
        steps.append(("load", "ok"))
        kind = group.removeprefix("asyncengine.")
        if kind == "general_plugins":
            obj()
            steps.append(("call", "ok"))
        elif kind == "platform_plugins":
            path = obj()
            steps.append(("detector", f"ok: {path!r}"))
            if path:
                steps.extend(_ask_platform(_import_class_path(path)))
        elif kind == "io_processor_plugins":
            from asyncengine.plugins_api import IOProcessor

            path = obj()
            cls = _import_class_path(path) if isinstance(path, str) else path
            steps.append(("IOProcessor subclass", "ok" if issubclass(cls, IOProcessor) else f"no: {cls!r}"))
        elif kind == "logits_processors":
            from asyncengine.plugins_api import LogitsProcessor

            steps.append(("LogitsProcessor subclass", "ok" if issubclass(obj, LogitsProcessor) else f"no: {obj!r}"))
    except BaseException as exc:  # noqa: BLE001  a survey: each plugin's first failure is the figure
        steps.append(("failed", _failure(exc)))
    return record


PLATFORM_QUESTIONS = ("is_cpu", "is_cuda", "is_cuda_alike", "is_rocm", "is_tpu", "is_xpu", "is_out_of_tree",
                      "get_device_name", "is_pin_memory_available", "device_count")


def _ask_platform(cls) -> list[tuple[str, str]]:
    """As vLLM's code asks `current_platform`, an instance of the class (some predicates are instance methods)."""
    from asyncengine.plugins_api import Platform

    steps = [("Platform subclass", "ok" if isinstance(cls, type) and issubclass(cls, Platform) else f"no: {cls!r}")]
    try:
        platform = cls()
    except BaseException as exc:  # noqa: BLE001
        steps.append(("built", _failure(exc)))
        return steps
    answered, failed = [], []
    for question in PLATFORM_QUESTIONS:
        try:
            answered.append(f"{question}={getattr(platform, question)()!r}")
        except BaseException as exc:  # noqa: BLE001
            failed.append(f"{question}: {_failure(exc)}")
    steps.append(("predicates", "; ".join(answered)))
    if failed:
        steps.append(("predicates failed", "; ".join(failed)))
    for attribute in ("device_name", "device_type", "dispatch_key", "dist_backend"):
        steps.append((attribute, repr(getattr(cls, attribute, "(none)"))))
    steps.extend(_ask_config_hook(cls))
    return steps


def _ask_config_hook(cls) -> list[tuple[str, str]]:
    """The platform's check_and_update_config on our config (built with no model, as vLLM's test builds
    VllmConfig()), then the worker class it names imported: the platform -> worker layer of the contract."""
    from asyncengine.plugins_api import VllmConfig

    config = VllmConfig(**json.loads(os.environ.get("AE_PROBE_OPTIONS", "{}")))
    try:
        cls.check_and_update_config(config)
    except BaseException as exc:  # noqa: BLE001
        return [("check_and_update_config", _failure(exc))]
    worker = config.parallel_config.worker_cls
    steps = [("check_and_update_config", f"ok: worker_cls={worker!r}")]
    if worker and worker != "auto":
        try:
            worker_cls = _import_class_path(worker)
            from asyncengine.plugins_api import Worker

            steps.append(("worker class", f"ok: {worker_cls.__qualname__}, a Worker: {issubclass(worker_cls, Worker)}"))
        except BaseException as exc:  # noqa: BLE001
            steps.append(("worker class", _failure(exc)))
    return steps


def _ask_registered(kind: str, key: str) -> dict:
    from asyncengine.interfaces.model_loader import LoadConfig, ModelLoaderRegistry
    from asyncengine.interfaces.quantization import QuantizationRegistry

    record: dict = {"kind": kind, "key": key, "steps": []}
    try:
        if kind == "quantization":
            cls = QuantizationRegistry.config_class(key)
            for method in ("get_name", "get_supported_act_dtypes", "get_min_capability", "get_config_filenames"):
                try:
                    record["steps"].append((method, repr(getattr(cls, method)())))
                except TypeError:  # an instance method (vLLM's get_supported_act_dtypes is one)
                    record["steps"].append((method, "an instance method: needs the config"))
        else:
            loader = ModelLoaderRegistry.loader_class(key)(LoadConfig(load_format=key))
            record["steps"].append(("built", type(loader).__qualname__))
    except BaseException as exc:  # noqa: BLE001
        record["steps"].append(("failed", _failure(exc)))
    return record


def _is_plugins_own(module: object, tree: Path) -> bool:
    """A Python module of the plugin or of its stubs and dependencies (beside it), not torch's nor a native one."""
    file = str(getattr(module, "__file__", None) or "")
    return file.endswith(".py") and (file.startswith(str(tree)) or file.startswith(str(tree) + "-stubs"))


def _import_all(tree: Path) -> dict:
    modules = []
    for path in sorted(tree.rglob("*.py")):
        parts = path.relative_to(tree).with_suffix("").parts
        if any(part.endswith((".dist-info", ".data")) or part.startswith("_stub") for part in parts):
            continue
        if not all((tree.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            continue
        if not all(part.isidentifier() for part in parts):  # a file no import statement can name (a.patch.py)
            continue
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    failed: dict[str, str] = {}
    for module in modules:
        before = set(sys.modules)
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001
            failed[module] = _failure(exc)
            for leftover in set(sys.modules) - before:  # what the failed import left half-done: tried afresh
                if _is_plugins_own(sys.modules[leftover], tree):
                    del sys.modules[leftover]
    return {"modules": len(modules), "failed": failed}


# -- the report ---------------------------------------------------------------------------------------------------


def write_stubs(folder: Path, modules: list[str]) -> None:
    for module in modules:
        path = folder.joinpath(*module.split("."))
        path.mkdir(parents=True, exist_ok=True)
        (path / "__init__.py").write_text(f'"""A stub of {module}: hardware this machine lacks."""\n')


def survey(name: str, version: str, cache: Path, workdir: Path, *, fetch: bool = False) -> dict | None:
    wheel = wheel_path(cache, name, version)
    if wheel is None:
        return None
    tree = workdir / name
    figures = port(wheel, tree)
    stubs = workdir / f"{name}-stubs"
    write_stubs(stubs, STUBS.get(name, []))
    unpack_dependencies(cache, name, stubs, fetch=fetch)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCENGINE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(stubs), str(ROOT)])
    env["AE_PROBE_OPTIONS"] = json.dumps(OPTIONS.get(name, {}))
    env["AE_PROBE_CLASSES"] = json.dumps(CLASSES.get(name, []))
    # Two fresh processes: a module whose import failed half-way leaves its imported submodules behind, which
    # would let a later import of the same package pass.
    figures["probe"] = {}
    for mode in ("--probe", "--probe-imports"):
        child = subprocess.run([sys.executable, __file__, mode, str(tree)], capture_output=True, text=True, env=env,
                               timeout=600)
        if child.returncode != 0:
            figures["probe"] = {"error": child.stderr[-2000:]}
            break
        figures["probe"].update(json.loads(child.stdout.strip().splitlines()[-1]))
    figures["stubs"] = STUBS.get(name, [])
    return figures


def print_text(name: str, version: str, what: str, figures: dict) -> None:
    print(f"\n== {name} {version}: {what}")
    print(f"   uses of vLLM names: {figures['mapped']} mapped, {figures['provided']} provided by name, "
          f"{figures['missing']} missing ({len(figures['missing_names'])} distinct names, "
          f"{figures['hand_lines']} lines to change by hand)")
    for missing, count in figures["missing_names"]:
        print(f"     missing x{count}: {missing}")
    for change in figures["hand_changes"]:
        print(f"   changed by hand before running: {change}")
    if figures["stubs"]:
        print(f"   stubbed (hardware runtime this machine lacks): {', '.join(figures['stubs'])}")
    probe_out = figures["probe"]
    if "error" in probe_out:
        print("   probe failed:", probe_out["error"])
        return
    imports = probe_out["imports"]
    print(f"   modules: {imports['modules'] - len(imports['failed'])} of {imports['modules']} import")
    by_failure: dict[str, list[str]] = {}
    for module, failure in sorted(imports["failed"].items()):
        by_failure.setdefault(failure, []).append(module)
    for failure, modules in sorted(by_failure.items(), key=lambda item: -len(item[1])):
        also = f" (and {len(modules) - 1} more)" if len(modules) > 1 else ""
        print(f"     {modules[0]}{also}: {failure}")
    for entry in probe_out["entry_points"]:
        print(f"   entry point {entry['group']} {entry['name']} = {entry['target']}")
        for step, result in entry["steps"]:
            print(f"     {step}: {result}")
    general = [e for e in probe_out["entry_points"] if e["group"] == "asyncengine.general_plugins"]
    if general and not probe_out["registered"]:
        print("   registered by its general plugins: no quantization method, no model loader")
    for registered in probe_out["registered"]:
        print(f"   registered {registered['kind']} {registered['key']}")
        for step, result in registered["steps"]:
            print(f"     {step}: {result}")


def markdown_row(name: str, version: str, figures: dict) -> str:
    probe_out = figures["probe"]
    imports = probe_out.get("imports", {"modules": 0, "failed": {}})
    entries = probe_out.get("entry_points", [])
    ran = sum(1 for e in entries if e["steps"] and e["steps"][-1][0] != "failed"
              and not e["steps"][0][1].startswith("no:"))
    return (f"| {name} {version} | {figures['mapped']} | {figures['provided']} | {figures['missing']} "
            f"({len(figures['missing_names'])} names) | {figures['hand_lines']} | "
            f"{imports['modules'] - len(imports['failed'])}/{imports['modules']} | {ran}/{len(entries)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plugins", nargs="*", help="distribution names (default: all pinned ones)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the wheels are kept")
    parser.add_argument("--download", action="store_true", help="fetch missing wheels from PyPI (pip download)")
    parser.add_argument("--markdown", action="store_true", help="print the summary table docs/porting.md holds")
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-imports", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return
    if args.probe_imports:
        print(json.dumps({"imports": _import_all(args.probe_imports)}))
        return
    chosen = [p for p in PLUGINS if not args.plugins or p[0] in args.plugins]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ae-public-plugins-") as workdir:
        for name, version, what in chosen:
            if args.download and wheel_path(args.cache, name, version) is None:
                download(args.cache, name, version)
            figures = survey(name, version, args.cache, Path(workdir), fetch=args.download)
            if figures is None:
                print(f"\n== {name} {version}: no wheel in {args.cache / name} (run with --download)")
                continue
            print_text(name, version, what, figures)
            rows.append(markdown_row(name, version, figures))
    if args.markdown:
        print("\n| plugin | mapped | provided by name | missing | lines to change | modules importing | "
              "entry points run |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
