"""Reading one adapter in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`.

What we serve: LoRA (`peft_type` "LORA") on the attention and MLP projections (q/k/v/o, gate/up/down;
our checkpoints fuse q/k/v and gate/up, the adapter's matrices are placed per projection, see
lora/layers.py), rank at most `max_lora_rank`, scaled by `lora_alpha / r`, or `lora_alpha / sqrt(r)`
with `use_rslora`. What we refuse, naming the field: `modules_to_save` (whole trained copies of layers),
extra vocabulary (trained embeddings or an LM head: `new_embeddings.safetensors`,
`trainable_token_indices`, embedding targets), DoRA, per-module rank or alpha patterns, LoRA biases,
`fan_in_fan_out`, and weights only in pickle form (`adapter_model.bin`).

The config is checked in the frontend (a bad adapter is a 400 before the request is queued) and again
in the worker, which checks every matrix's shape against the model's layers (lora/pool.py): when an
adapter is loaded by name (from the safetensors header alone) and when a request brings it.

Adapter files come from users (a load route, a resolver directory): each is opened once, without
blocking, and read only when it is a regular file (a FIFO would block the reader until someone writes
to it, a device could be endless); the config within MAX_CONFIG_BYTES and MAX_CONFIG_DEPTH levels of
nesting (deeper JSON would exhaust the parser's recursion), the safetensors header within
MAX_HEADER_BYTES. The frontend reads in a worker thread under a time limit (frontend/lora.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from asyncengine.json_nesting import nested_deeper_than

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Bounds on what one adapter's files may make a reader do (docs/lora.md, "Limits"). PEFT writes configs
# of a few KB nested 3 levels deep, and a safetensors header of about 150 bytes per matrix.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_HEADER_BYTES = 16 << 20
# Checkpoint projection names an adapter may target (transformers' names, before our fusing).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VOCAB_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings")
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter we cannot serve; `field` names what is wrong (an adapter_config.json key, or lora_path)."""

    def __init__(self, message: str, *, field: str = "lora_path") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def read_adapter_config(path: str, *, max_rank: int, name: str = "") -> AdapterConfig:
    """The checked config of the adapter in directory `path`; LoRAAdapterError naming the field if refused."""
    label = _label(path, name)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"{label}: lora_path is not a directory; give a local directory holding "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    raw = _read_config_json(os.path.join(path, CONFIG_FILE), label)
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} must hold a JSON object")
    if not os.path.lexists(os.path.join(path, WEIGHTS_FILE)):
        extra = " (adapter_model.bin is a pickle, which we do not load: save with safe_serialization)" if (
            os.path.isfile(os.path.join(path, "adapter_model.bin"))) else ""
        raise LoRAAdapterError(f"{label}: no {WEIGHTS_FILE}{extra}")
    with _open_regular(os.path.join(path, WEIGHTS_FILE), label, WEIGHTS_FILE):
        pass  # a regular file (a FIFO or a device is refused here, before anything reads it)
    _refuse_unsupported(raw, path, label)
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{label}: r must be a positive int, got {rank!r}", field="r")
    if rank > max_rank:
        raise LoRAAdapterError(f"{label}: its rank r={rank} exceeds max_lora_rank={max_rank}; start the engine "
                               f"with --max-lora-rank {rank} (or more)", field="r")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{label}: lora_alpha must be a number, got {alpha!r}", field="lora_alpha")
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)))


@contextmanager
def _open_regular(file_path: str, label: str, what: str) -> Iterator[int]:
    """The file's descriptor, opened without blocking, once it is known to be a regular file; else
    LoRAAdapterError. Opening a FIFO for reading blocks until a writer comes (O_NONBLOCK: it returns at
    once), so the type is checked on the descriptor, never on the path (the file could be swapped between)."""
    try:
        fd = os.open(file_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LoRAAdapterError(f"{label}: no {what}; is this a PEFT adapter directory?") from None
    except OSError as exc:  # a socket (ENXIO), no permission, a loop of links, ...
        raise LoRAAdapterError(f"{label}: {what} cannot be opened: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file")
            raise LoRAAdapterError(f"{label}: {what} is {kind}; adapter files must be regular files")
        yield fd
    finally:
        os.close(fd)


def _read_bounded(fd: int, limit: int, label: str, what: str) -> bytes:
    """All of a regular file's bytes, refused past `limit` (checked on what is read: the file may grow)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise LoRAAdapterError(f"{label}: {what} is {size} bytes, more than the {limit} bytes allowed")
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise LoRAAdapterError(f"{label}: {what} is more than the {limit} bytes allowed")
    return b"".join(chunks)


def _read_config_json(config_path: str, label: str) -> Any:
    with _open_regular(config_path, label, CONFIG_FILE) as fd:
        data = _read_bounded(fd, MAX_CONFIG_BYTES, label, CONFIG_FILE)
    if nested_deeper_than(data, MAX_CONFIG_DEPTH):  # before json, whose recursion it would exhaust
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} is nested more than {MAX_CONFIG_DEPTH} levels deep (arrays "
                               "and objects within each other); an adapter config needs a few")
    try:
        return json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError among them
        raise LoRAAdapterError(f"{label}: {CONFIG_FILE} cannot be read as JSON: {exc}") from exc


@contextmanager
def _checked_weights_file(path: str, label: str) -> Iterator[str]:
    """A path safetensors may open for the adapter's weights: a regular file whose header is within
    MAX_HEADER_BYTES, opened once; the path names that very descriptor (/proc/self/fd), so the file
    checked is the file read."""
    with _open_regular(os.path.join(path, WEIGHTS_FILE), label, WEIGHTS_FILE) as fd:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) == 8 and struct.unpack("<Q", prefix)[0] > MAX_HEADER_BYTES:
            raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} declares a header of {struct.unpack('<Q', prefix)[0]} "
                                   f"bytes, more than the {MAX_HEADER_BYTES} bytes allowed")
        by_descriptor = f"/proc/self/fd/{fd}"
        yield by_descriptor if os.path.exists(by_descriptor) else os.path.join(path, WEIGHTS_FILE)


def _refuse_unsupported(raw: dict[str, Any], path: str, label: str) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{label}: peft_type is {peft_type!r}; only LoRA adapters (LORA) are served",
                               field="peft_type")
    if raw.get("modules_to_save"):
        raise LoRAAdapterError(f"{label}: modules_to_save={raw['modules_to_save']!r} is not supported (whole "
                               "trained copies of layers); only LoRA matrices are served", field="modules_to_save")
    if raw.get("trainable_token_indices") or os.path.isfile(os.path.join(path, "new_embeddings.safetensors")):
        field = "trainable_token_indices" if raw.get("trainable_token_indices") else "new_embeddings"
        raise LoRAAdapterError(f"{label}: adapters with extra vocabulary ({field}) are not supported",
                               field=field)
    targets = raw.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in names:
        if any(vocab in str(target) for vocab in _VOCAB_MODULES):
            raise LoRAAdapterError(f"{label}: target_modules includes {target!r}: LoRA on the embeddings or the LM "
                                   "head (extra vocabulary) is not supported", field="target_modules")
    if raw.get("use_dora"):
        raise LoRAAdapterError(f"{label}: use_dora is set; DoRA adapters are not supported", field="use_dora")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise LoRAAdapterError(f"{label}: {key} is not supported (one rank and alpha for every module)",
                                   field=key)
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{label}: bias={raw['bias']!r} is not supported; only bias='none'", field="bias")
    if raw.get("fan_in_fan_out"):
        raise LoRAAdapterError(f"{label}: fan_in_fan_out is not supported (Conv1D-style weights)",
                               field="fan_in_fan_out")


# (layer index, checkpoint projection name) -> (A [r, in], B [out, r]), as the file holds them.
AdapterWeights = dict[tuple[int, str], tuple[Any, Any]]
# The same keys -> the shapes of A and B, read from the file's header alone (no tensor data).
AdapterShapes = dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]


def read_adapter_weights(path: str, *, name: str = "") -> AdapterWeights:
    """The LoRA matrices of every targeted projection (CPU tensors); LoRAAdapterError for anything else."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    label = _label(path, name)
    try:
        with _checked_weights_file(path, label) as file_path:
            tensors = load_file(file_path, device="cpu")
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    return _pairs(tensors, path, name)


def read_adapter_shapes(path: str, *, name: str = "") -> AdapterShapes:
    """The shapes of every targeted projection's A and B, from the safetensors header (cheap: no tensor is
    read); LoRAAdapterError as `read_adapter_weights` raises it."""
    from safetensors import SafetensorError, safe_open

    label = _label(path, name)
    try:
        with _checked_weights_file(path, label) as file_path, safe_open(file_path, framework="pt") as file:
            shapes = {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    return _pairs(shapes, path, name)


def _label(path: str, name: str) -> str:
    return f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"


def _pairs(by_name: dict[str, Any], path: str, name: str) -> dict[tuple[int, str], tuple[Any, Any]]:
    """`by_name` (tensor name -> a tensor or its shape) as (layer, projection) -> (A's, B's)."""
    label = _label(path, name)
    halves: dict[tuple[int, str], dict[str, Any]] = {}
    for tensor_name, value in by_name.items():
        match = _TENSOR_NAME.search(tensor_name)
        if match is None:
            raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} holds {tensor_name!r}, which is not a LoRA matrix of "
                                   f"an attention or MLP projection ({', '.join(SUPPORTED_MODULES)})",
                                   field="target_modules")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in SUPPORTED_MODULES:
            raise LoRAAdapterError(f"{label}: it targets {module!r}; supported target modules are "
                                   f"{', '.join(SUPPORTED_MODULES)}", field="target_modules")
        halves.setdefault((layer, module), {})[half] = value
    pairs: dict[tuple[int, str], tuple[Any, Any]] = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{label}: layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        pairs[key] = (pair["A"], pair["B"])
    if not pairs:
        raise LoRAAdapterError(f"{label}: {WEIGHTS_FILE} holds no LoRA matrices")
    return pairs


__all__ = ["AdapterConfig", "AdapterShapes", "AdapterWeights", "LoRAAdapterError", "SUPPORTED_MODULES",
           "read_adapter_config", "read_adapter_shapes", "read_adapter_weights"]
