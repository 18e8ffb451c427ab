"""GGUF's K-quant super-blocks as blocks of 32 inputs with one scale and one offset each (loader/gguf_blocks.py).

A K-quant packs 256 inputs of a row in a super-block: small integers, per-sub-block scales (and for Q4_K / Q5_K
minimums) quantized in turn under fp16 factors. The integers' bit layout is read by gguf's own dequantization:
each reader sets a copy's factors and scales to 1 (and minimums to 0), so that `gguf.quants.dequantize` returns the
integers themselves, and then reads the real scales. What comes back is (q int8 `[rows, cols]`, scale and offset
float32 `[rows, cols / 32]`), with `scale * q + offset` the weight:

- Q4_K, Q5_K (`w = d sc q - dmin m`, q in [0, 15] / [0, 31], eight sub-blocks of 32): q as it is, scale `d sc`,
  offset `-dmin m`. `d sc` and `dmin m` (fp16 times a 6-bit integer) are exact in float32, and so is `d sc q`:
  `scale * q + offset` rounds once, where gguf's dequantization does, to the same float32 value.
- Q3_K (`w = d sc q`, q in [-4, 3], signed 6-bit scales per 16 inputs): scale `-d`, q `-sc q`, in [-128, 124],
  so one int8 holds it whatever the two scales of a block of 32; the products are exact: the file's values.
- Q6_K (`w = d sc q`, q in [-32, 31], int8 scales per 16 inputs): a block of 32 has two scales `sa`, `sb` and
  no int8 q with one scale holds both halves in general. Requantized: with `big` the scale of larger magnitude,
  scale `d big / 4`; the half of `big` keeps `4 q` (exact), the other half gets `round(4 q s / big)` (`s` its
  scale, |s / big| <= 1). Each weight is then within half a step (`|d big| / 8`) of the file's value, except
  where the other half's scale is `-big` and q is -32 (128 clipped to 127: one step, `|d big| / 4`). That is
  at most a quarter of the coarser half's own step, and about the error of re-quantizing the weights as Q8_0.
- Q2_K has a minimum per 16 inputs, which one offset per 32 cannot hold: not kept (the float weights are).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SUPER = 256
# Inputs per block of the kept format: gguf_blocks.BLOCK, which imports this module (so it cannot be imported
# from there); tests/loader/test_gguf_blocks.py holds the two equal.
BLOCK = 32
_ONE_FP16 = np.array([1.0], dtype=np.float16).view(np.uint8)


def _super_blocks(raw: np.ndarray, size: int, rows: int, cols: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows * cols // SUPER, size)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _integers(blocks: np.ndarray, type_name: str, settings: dict[tuple[int, int], np.ndarray | bytes]) -> np.ndarray:
    """The super-blocks' integers, [n, 256] int16: gguf's dequantization of a copy whose factors, scales and
    minimums are overwritten as `settings` says (byte range -> bytes) so that each weight reads as its q."""
    import gguf

    unit = blocks.copy()
    for (start, stop), value in settings.items():
        unit[:, start:stop] = np.frombuffer(bytes(value), dtype=np.uint8)
    values = gguf.quants.dequantize(unit, gguf.GGMLQuantizationType[type_name])
    q = np.rint(values).astype(np.int16)
    return q.reshape(len(blocks), SUPER)


def _rows(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, rows: int, cols: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return (q.astype(np.int8).reshape(rows, cols), scale.astype(np.float32).reshape(rows, cols // BLOCK),
            None if offset is None else offset.astype(np.float32).reshape(rows, cols // BLOCK))


# Q4_K / Q5_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, then the integers. With the bytes below
# every sub-block's scale is 1 and minimum 0 (ggml's packing: bytes 0-3 scales 0-3, 4-7 minimums 0-3, 8-11 the
# low nibbles of scales 4-7 and high nibbles of minimums 4-7; the top two bits of 0-7 are the high bits of 4-7).
_UNIT_SCALES_MINS = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])


def _scale_min_blocks(raw: np.ndarray, type_name: str, size: int, rows: int, cols: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    import gguf

    blocks = _super_blocks(raw, size, rows, cols)
    q = _integers(blocks, type_name, {(0, 2): _ONE_FP16.tobytes(), (2, 4): bytes(2), (4, 16): _UNIT_SCALES_MINS})
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    scale = d[:, None] * sc.astype(np.float32)
    offset = -(dmin[:, None] * m.astype(np.float32))
    return _rows(q, scale, offset, rows, cols)


def q4_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _scale_min_blocks(raw, "Q4_K", 144, rows, cols)


def q5_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _scale_min_blocks(raw, "Q5_K", 176, rows, cols)


def q3_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q3_K: 32 bytes of high bits, 64 of low bits, 12 of scales, fp16 d. A scale is 6 bits less 32: its low
    nibble in byte j % 8 (shifted by 4 for j >= 8), its top two bits in byte 8 + j % 4 (shifted by 2 (j // 4))."""
    blocks = _super_blocks(raw, 110, rows, cols)
    unit = bytes([0x11] * 8 + [0xAA] * 4)  # every scale 33 - 32 = 1
    q = _integers(blocks, "Q3_K", {(96, 108): unit, (108, 110): _ONE_FP16.tobytes()})
    packed = blocks[:, 96:108].astype(np.int16)
    j = np.arange(16)
    low = (packed[:, j % 8] >> (4 * (j // 8))) & 0x0F
    high = (packed[:, 8 + j % 4] >> (2 * (j // 4))) & 0x03
    sc = (low | (high << 4)) - 32  # [n, 16], one per 16 inputs
    d = _fp16(blocks, 108)
    q = -(q.reshape(-1, 16, 16) * sc[:, :, None])  # in [-128, 124]
    scale = np.repeat(-d[:, None], SUPER // BLOCK, axis=1)
    return _rows(q, scale, None, rows, cols)


def q6_k_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q6_K: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, fp16 d; requantized per block of 32 as
    the module's docstring says."""
    blocks = _super_blocks(raw, 210, rows, cols)
    q = _integers(blocks, "Q6_K", {(192, 208): bytes([1] * 16), (208, 210): _ONE_FP16.tobytes()})  # q - 32
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.int32).reshape(-1, 8, 2)  # [n, blocks of 32, halves]
    d = _fp16(blocks, 208)
    halves = q.reshape(-1, 8, 2, 16).astype(np.int32)
    big_is_second = np.abs(sc[:, :, 1]) > np.abs(sc[:, :, 0])
    big = np.where(big_is_second, sc[:, :, 1], sc[:, :, 0])  # [n, 8]
    safe = np.where(big == 0, 1, big)
    # 4 q s / big for both halves: exactly 4 q on big's half (s = big), rounded (half to even) on the other.
    ratio = (4 * halves * sc[:, :, :, None]).astype(np.float64) / safe[:, :, None, None]
    requantized = np.clip(np.rint(ratio), -128, 127)
    requantized[big == 0] = 0
    scale = d[:, None] * big.astype(np.float32) / np.float32(4)
    return _rows(requantized.reshape(-1, SUPER), scale, None, rows, cols)


READERS: dict[str, Callable[[np.ndarray, int, int], tuple[np.ndarray, np.ndarray, np.ndarray | None]]] = {
    "Q3_K": q3_k_blocks, "Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks,
}


def q6_k_error_bound(scale: np.ndarray) -> np.ndarray:
    """The most a requantized Q6_K weight may differ from the file's, per block of 32: one step of the new
    scale (half a step but where a q of -32 met a scale of -big, see the module's docstring)."""
    return np.abs(scale)
