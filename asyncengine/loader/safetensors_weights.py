"""Reading checkpoint tensors from *.safetensors files, sharded or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from asyncengine.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def find_weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of `model_dir`: those its index names, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names weight files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
        raise ModelLoadError(f"no *.safetensors weight file in {model_dir}{hint}")
    return files


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every file, naming the file when one is unreadable."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weight file {path} is unreadable or corrupt: {exc}") from exc
