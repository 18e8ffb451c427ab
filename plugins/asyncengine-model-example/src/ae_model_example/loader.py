"""The model family's own weight format, `example_npz`: one NumPy archive, `weights.npz`, in the model
directory (names as in the safetensors checkpoint). Registered by the general plugin with
ModelLoaderRegistry (EXTENSION_POINTS.md R5) and chosen with `--load-format example_npz`; the worker,
which builds the model, runs it (the frontend only checks that the name is known).

`save_npz(model_dir)` writes the archive from a safetensors checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ae_model_example._record import record
from asyncengine.plugins_api import BaseModelLoader

__all__ = ["LOAD_FORMAT", "WEIGHTS_FILE", "ExampleNpzLoader", "save_npz"]

LOAD_FORMAT = "example_npz"
WEIGHTS_FILE = "weights.npz"


class ExampleNpzLoader(BaseModelLoader):
    def load_weights(self, model: Any, model_config: Any) -> None:
        import numpy as np
        import torch

        path = Path(model_config.model_dir) / WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"load format {LOAD_FORMAT!r} reads {path}, which does not exist; write it "
                                    "with ae_model_example.loader.save_npz(model_dir)")
        with np.load(path) as archive:
            names = list(archive.files)
            model.load_weights((name, torch.from_numpy(archive[name])) for name in names)
        record("weights loaded", load_format=LOAD_FORMAT, tensors=len(names))


def save_npz(model_dir: str | Path) -> Path:
    """Write `weights.npz` next to the model's *.safetensors files (float32 or float16 checkpoints:
    NumPy has no bfloat16)."""
    import numpy as np
    from safetensors.numpy import load_file

    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors file to convert")
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    target = directory / WEIGHTS_FILE
    np.savez(target, **tensors)
    return target
