"""Turn the `model` (and `tokenizer`, `hf_config_path`) arguments into local HuggingFace-style directories.

`model` is, in this order (docs/configuration.md, "Where the model comes from"):
1. None or a packaged model's name (the default SmolLM2-135M-Instruct, Gemma 3 270M): its package's GGUF file
   (loader/packaged_models.py), converted once into a cached directory;
2. a local directory (config.json plus *.safetensors, or exactly one .gguf file) or a local .gguf file;
3. a hub name, `ORG/NAME` (its snapshot) or `ORG/NAME:QUANT` / `ORG/NAME/FILE.gguf` (one GGUF file of it),
   from the Hugging Face cache or downloaded (loader/hub.py), at `revision`.
"""

from __future__ import annotations

from pathlib import Path

from asyncengine.config.model import DEFAULT_MODEL_NAME
from asyncengine.errors import ModelLoadError
from asyncengine.loader import hub
from asyncengine.loader.packaged_models import SMOLLM2, gguf_path, packaged_model

DEFAULT_MODEL_ALIASES = frozenset({SMOLLM2.name, *SMOLLM2.aliases})


def resolve_model_dir(model: str | None, *, cache_dir: str | None = None, progress: bool = True,
                      revision: str | None = None) -> Path:
    """The local directory holding config.json for `model`, converting a GGUF file when needed."""
    from asyncengine.loader import gguf  # imports the gguf package only when a model needs it

    cache_root = _cache_root(cache_dir)
    packaged = packaged_model(model)
    if packaged is not None or model is None:  # (None is the default model: packaged_model says so)
        packaged = packaged or SMOLLM2
        return gguf.convert_gguf_to_hf_dir(gguf_path(packaged, cache_root or gguf.default_cache_root()),
                                           cache_root, progress=progress)
    local = _local_dir(model, cache_root, progress=progress)
    if local is not None:
        return local
    if not hub.is_hub_name(model):
        raise ModelLoadError(
            f"model {model!r} is neither a local directory nor a .gguf file, nor a model name of the form ORG/NAME "
            f"(a Hugging Face hub repository): pass a model directory, a .gguf file or ORG/NAME, or leave the model "
            f"out to use the default model ({DEFAULT_MODEL_NAME})"
        )
    settings = hub.HubSettings.from_environment(cache_dir)
    reference = hub.gguf_reference(model)
    if reference is not None:
        repo_id, quant, filename = reference
        path = hub.gguf_file(repo_id, quant, filename, revision, settings)
        return gguf.convert_gguf_to_hf_dir(path, cache_root, progress=progress)
    folder = hub.snapshot(model, revision, settings, hub.MODEL_FILES)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"model {model!r} (revision {revision or 'main'!r}, in {folder}) has no config.json; a repository of "
            f"GGUF files is named with its file: {model}:QUANT (a type such as Q4_K_M) or {model}/FILE.gguf"
        )
    return folder


def resolve_files_dir(name: str, *, cache_dir: str | None, revision: str | None, what: str) -> Path:
    """The local directory `name` (`tokenizer` or `hf_config_path`: a directory, or a hub name whose tokenizer
    or config files are fetched)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if not hub.is_hub_name(name) or hub.gguf_reference(name) is not None:
        raise ModelLoadError(f"{what} {name!r} is neither a local directory nor a hub name of the form ORG/NAME")
    settings = hub.HubSettings.from_environment(cache_dir)
    patterns = hub.TOKENIZER_FILES if what == "tokenizer" else hub.CONFIG_FILES
    return hub.snapshot(name, revision, settings, patterns, what=what)


def _local_dir(model: str, cache_root: Path | None, *, progress: bool) -> Path | None:
    from asyncengine.loader import gguf

    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"model {model!r} is a file but not a .gguf file; pass a model directory "
                "(config.json and *.safetensors) or a .gguf file"
            )
        return gguf.convert_gguf_to_hf_dir(path.resolve(), cache_root, progress=progress)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return gguf.convert_gguf_to_hf_dir(gguf_files[0].resolve(), cache_root, progress=progress)
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json"
            + (f" and {len(gguf_files)} .gguf files (pass one of them)" if gguf_files else "")
        )
    return None


def _cache_root(cache_dir: str | None) -> Path | None:
    return Path(cache_dir).expanduser() if cache_dir else None
