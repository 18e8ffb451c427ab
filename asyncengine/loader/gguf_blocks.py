"""A GGUF file's quantized linear weights as they are: per block of 32 inputs, small integers, a scale and an
offset (`quantization="gguf"`, models/layers/gguf_linear.py).

The converter (loader/gguf.py) writes them beside the dequantized checkpoint, in `BLOCKS_FILE` of the cached
directory: for each linear weight `<name>.q` (int8 `[rows, cols]`), `<name>.scale` and, for the types with a
minimum, `<name>.offset` (float32 `[rows, cols / 32]`); each weight is `scale * q + offset`. config.json's
`CONFIG_KEY` says which file they came from and which linear weights have a type we cannot keep. The loader
hands each such weight to its layer as `BlockQuantizedRows` instead of float rows.

Block layouts (ggml's): Q8_0 = fp16 d, 32 int8; Q4_0 = fp16 d, 16 bytes of nibbles (low nibbles are inputs
0-15, high nibbles 16-31), w = d (q - 8); Q4_1 = fp16 d, fp16 m, nibbles, w = d q + m; Q5_0 / Q5_1 add a
32-bit word of fifth bits (bit j for input j), w = d (q - 16) / d q + m.

The K-quants pack 256 inputs in a super-block (loader/gguf_kquants.py reads them): Q4_K and Q5_K have eight
sub-blocks of 32 with 6-bit scales and minimums under two fp16 factors, `w = (d sc) q - (dmin m)`, kept exactly
(q unsigned, scale `d sc`, offset `-dmin m`: both products are exact in float32); Q3_K has sixteen sub-blocks of
16 with signed 6-bit scales, `w = d sc q`, kept exactly as one block of 32 with scale `-d` and q `-sc q` (which
always fits in int8); Q6_K has sixteen sub-blocks of 16 with int8 scales, which no single scale per 32 inputs
holds exactly in int8: it is requantized (`REQUANTIZED`), see `gguf_kquants.q6_k_blocks` for its error bound.
Q2_K (a minimum per 16 inputs) and the IQ types are not kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncengine.errors import ModelLoadError
from asyncengine.loader import gguf_kquants

if TYPE_CHECKING:
    import torch

BLOCK = 32
BLOCKS_FILE = "gguf_blocks/linear.safetensors"  # in a subfolder: the float loader globs *.safetensors
CONFIG_KEY = "asyncengine_gguf_blocks"
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Kept within a stated bound instead of exactly (gguf_kquants.q6_k_blocks); every other kept type is exact.
REQUANTIZED = ("Q6_K",)

# type -> (bytes per block, has a minimum, bits per value)
_LAYOUT = {"Q8_0": (34, False, 8), "Q4_0": (18, False, 4), "Q4_1": (20, True, 4), "Q5_0": (22, False, 5),
           "Q5_1": (24, True, 5)}


def split_blocks(raw: np.ndarray, ggml_type: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray,
                                                                                    np.ndarray | None]:
    """A tensor's raw blocks (`rows * cols / 32` of them, row-major) as (q int8 `[rows, cols]`, scale and offset
    float32 `[rows, cols / 32]`; offset None for the types without a minimum), with `scale * q + offset` the
    weight. Q4_1's `d * q4 + m` becomes `d * (q4 - 8) + (m + 8 d)`, so that q is signed."""
    if ggml_type in gguf_kquants.READERS:
        return gguf_kquants.READERS[ggml_type](raw, rows, cols)
    size, has_min, bits = _LAYOUT[ggml_type]
    n_blocks = rows * cols // BLOCK
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(n_blocks, size)
    d = data[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    at = 2
    m = None
    if has_min:
        m = data[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        at = 4
    if bits == 8:
        q = data[:, at:at + BLOCK].view(np.int8).astype(np.int16)
        centre = 0
    else:
        high_bits = None
        if bits == 5:
            high_bits = data[:, at:at + 4].copy().view("<u4")[:, 0]
            at += 4
        nibbles = data[:, at:at + 16]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int16)
        if high_bits is not None:
            fifth = (high_bits[:, None] >> np.arange(BLOCK, dtype=np.uint32)[None, :]) & 1
            q |= (fifth.astype(np.int16) << 4)
        centre = 1 << (bits - 1)
        q -= centre
    offset = None
    if m is not None:
        offset = (m + np.float32(centre) * d).astype(np.float32).reshape(rows, cols // BLOCK)
    return q.astype(np.int8).reshape(rows, cols), d.reshape(rows, cols // BLOCK), offset


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    rows, cols = q.shape
    w = q.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32) * scale[:, :, None]
    if offset is not None:
        w += offset[:, :, None]
    return w.reshape(rows, cols)


@dataclass(frozen=True)
class BlockQuantizedRows:
    """A linear weight as its blocks, narrowed as a layer takes its tensor-parallel part (`shape`, `narrow`,
    like the float tensor it stands for)."""

    q: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols / 32]
    offset: torch.Tensor | None  # float32, as scale
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def narrow(self, dim: int, start: int, length: int) -> BlockQuantizedRows:
        if dim == 0:
            return BlockQuantizedRows(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                                      None if self.offset is None else self.offset.narrow(0, start, length), self.name)
        if start % BLOCK or length % BLOCK:
            raise ModelLoadError(
                f"{self.name}: this rank's input columns [{start}, {start + length}) split the GGUF file's blocks "
                f"of {BLOCK}; quantization='gguf' needs each tensor-parallel part to hold whole blocks "
                f"(use fewer tensor-parallel ranks)")
        first, count = start // BLOCK, length // BLOCK
        return BlockQuantizedRows(self.q.narrow(1, start, length), self.scale.narrow(1, first, count),
                                  None if self.offset is None else self.offset.narrow(1, first, count), self.name)


def with_blocks(weights: Iterable[tuple[str, Any]], model_dir: Path) -> Iterator[tuple[str, Any]]:
    """`weights` with each linear weight the blocks file holds given as its `BlockQuantizedRows`."""
    from safetensors import SafetensorError, safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no GGUF blocks ({BLOCKS_FILE}): quantization='gguf' runs a GGUF "
                             f"file's quantized weights; pass a .gguf file (or leave the model out for the default)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            for name, tensor in weights:
                if f"{name}.q" not in names:
                    yield name, tensor
                    continue
                offset = handle.get_tensor(f"{name}.offset") if f"{name}.offset" in names else None
                yield name, BlockQuantizedRows(handle.get_tensor(f"{name}.q"), handle.get_tensor(f"{name}.scale"),
                                               offset, name)
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"the GGUF blocks file {path} is unreadable or corrupt: {exc}") from exc


def describe_in_config(source: str, kept: dict[str, str], not_kept: dict[str, str],
                       requantized_error: dict[str, float] | None = None) -> dict[str, Any]:
    """config.json's `CONFIG_KEY`: the file, the linear weights' types kept, those that cannot be, and for each
    requantized type the largest difference from the file's values relative to its tensor's largest weight."""
    summary: dict[str, Any] = {"file": source, "kept_types": sorted(set(kept.values())),
                               "not_kept": dict(sorted(not_kept.items()))}
    if requantized_error:
        summary["requantized"] = {kind: float(f"{error:.3g}") for kind, error in sorted(requantized_error.items())}
    return summary


def blocks_summary(hf_config: Any) -> dict[str, Any] | None:
    value = getattr(hf_config, CONFIG_KEY, None)
    if isinstance(value, str):  # a config round-tripped as text
        value = json.loads(value)
    return value if isinstance(value, dict) else None
