"""Random PEFT LoRA adapters on the tiny models (tests/support/tiny_models.py), and transformers+peft as
their reference. `init_lora_weights=False` draws A and B at random (PEFT's default starts B at zero,
which would make every adapter the base model)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


PEFT_VERSION = "0.21.2"


def peft_module(tmp_path_factory: Any) -> Any:
    """The `peft` package: importable already, else installed (no dependencies) into a temporary target put on
    sys.path, never into .venv."""
    try:
        return importlib.import_module("peft")
    except ImportError:
        pass
    target = tmp_path_factory.mktemp("peft-target")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    f"peft=={PEFT_VERSION}"], check=True, capture_output=True, text=True, timeout=300)
    sys.path.insert(0, str(target))
    return importlib.import_module("peft")


@dataclass
class Adapter:
    name: str
    path: Path
    reference: Any  # transformers' model with the adapter applied (peft), float32, eval mode


def make_adapter(peft: Any, base_path: Path, directory: Path, *, name: str, rank: int, targets: list[str],
                 alpha: float = 16.0, use_rslora: bool = False, seed: int = 0, scale: float = 1.0) -> Adapter:
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32,
                                                             attn_implementation="eager")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                             lora_dropout=0.0, init_lora_weights=False, bias="none")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question (is_gradient_checkpointing)
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(base, config)
    if scale != 1.0:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(scale)
    model.eval()
    model.save_pretrained(directory)
    # transformers' own model with peft's LoRA layers in it: its forward takes the cache by its current name.
    return Adapter(name, directory, model.base_model.model)


# The tiny Llama (tests/support/tiny_models.py): hidden 96, 6 heads of 16 with 2 KV heads, MLP 160, 2 layers.
TINY_LLAMA_SHAPES = {"q_proj": (96, 96), "k_proj": (96, 32), "v_proj": (96, 32), "o_proj": (96, 96),
                     "gate_proj": (96, 160), "up_proj": (96, 160), "down_proj": (160, 96)}


def write_adapter(directory: Path, *, rank: int = 4, seed: int = 0, targets=("q_proj", "v_proj"),
                  shapes=TINY_LLAMA_SHAPES, **config: Any) -> Path:
    """Random matrices in PEFT's file format (no peft needed): for tests of the pool and the checks."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for target in targets:
            in_features, out_features = shapes[target]
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(out_features, rank, generator=generator)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(targets), "bias": "none",
         **config}))
    return directory
