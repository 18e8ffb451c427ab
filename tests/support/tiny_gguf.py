"""Tiny GGUF files of each architecture the converter reads (loader/gguf_arch.py), written as llama.cpp names and
lays them out: metadata keys, tensor names, a tokenizer in the metadata, and linear weights in the quant types a
test asks for, K-quants included.

The gguf package quantizes only the 32-wide types (Q4_0 ... Q8_0); K-quant super-blocks are made directly: random
integer bytes under fp16 factors chosen so that the weights come out near the tiny models' scale (0.2). The file
is the source of truth: tests compare what the converter makes of it with what transformers makes of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! The model answers questions.",
    "def square(x):\n    return x * x  # 1234567890 numbers and code",
    "Sliding windows, soft caps and quantized blocks: the converter reads them all.",
]
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# type -> (bytes per super-block, byte offsets of its fp16 factors and their magnitude)
_K_LAYOUTS = {"Q2_K": (84, {80: 0.004, 82: 0.004}), "Q3_K": (110, {108: 0.002}),
              "Q4_K": (144, {0: 0.0003, 2: 0.0003}), "Q5_K": (176, {0: 0.00015, 2: 0.00015}),
              "Q6_K": (210, {208: 0.00005})}


@dataclass
class TinySpec:
    arch: str
    tokenizer: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    name: str = "tiny"
    hidden: int = 256
    inter: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    tied: bool = False
    types: dict[str, str] = field(default_factory=dict)  # GGUF kind (attn_q, ffn_down, ...) -> quant type
    extra: dict[str, object] = field(default_factory=dict)  # more `<arch>.*` metadata (float, int or str)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # more float32 tensors, by GGUF name


def _gpt2_vocab() -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=GPT2_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    import json

    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def gpt2_reference_tokenizer():
    """The byte-level BPE the gpt2-type files hold, built with `tokenizers` from the trained vocabulary and merges
    and the text split Qwen2's tokenizer.json states (the files say `tokenizer.ggml.pre = qwen2`): the ids a file's
    tokenizer must give."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokens, merges = _gpt2_vocab()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(GPT2_SPECIALS)
    return tokenizer


def _spm_vocab() -> list[str]:
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 20, vocab_size=300, show_progress=False)
    pieces = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda item: item[1])]
    return SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + [p for p in pieces if p not in SPM_SPECIALS]


def _add_tokenizer(writer, kind: str) -> int:
    import gguf

    if kind == "gpt2":
        tokens, merges = _gpt2_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in GPT2_SPECIALS else gguf.TokenType.NORMAL
                                for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
        return len(tokens)
    tokens = _spm_vocab()
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)])
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    return len(tokens)


def _k_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    size, factors = _K_LAYOUTS[type_name]
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at, magnitude in factors.items():
        value = (rng.uniform(0.5, 1.5, n) * magnitude).astype(np.float16)
        blocks[:, at:at + 2] = value.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * size)


def _tensor(writer, name: str, shape: tuple[int, ...], type_name: str, rng: np.random.Generator,
            *, around: float = 0.0) -> None:
    import gguf

    if type_name in _K_LAYOUTS:
        rows, cols = shape
        writer.add_tensor(name, _k_blocks(type_name, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[type_name])
        return
    w = (around + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    if type_name == "F32":
        writer.add_tensor(name, w)
        return
    ggml_type = gguf.GGMLQuantizationType[type_name]
    writer.add_tensor(name, gguf.quants.quantize(w, ggml_type), raw_dtype=ggml_type)


def _layer_tensors(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    h, inter, q, kv = spec.hidden, spec.inter, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    tensors: dict[str, tuple[int, ...]] = {"attn_norm": (h,), "ffn_norm": (h,), "attn_output": (h, q),
                                           "ffn_down": (h, inter)}
    if spec.arch == "phi3":
        tensors.update(attn_qkv=(q + 2 * kv, h), ffn_up=(2 * inter, h))
        return tensors
    tensors.update(attn_q=(q, h), attn_k=(kv, h), attn_v=(kv, h), ffn_gate=(inter, h), ffn_up=(inter, h))
    if spec.arch in ("qwen3", "gemma3"):
        tensors.update(attn_q_norm=(spec.head_dim,), attn_k_norm=(spec.head_dim,))
    if spec.arch in ("gemma2", "gemma3"):
        tensors.update(post_attention_norm=(h,), post_ffw_norm=(h,))
    return tensors


def write_tiny_gguf(path: Path, spec: TinySpec, *, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(spec.name)
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.inter)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(20000.0)
    for key, value in spec.extra.items():
        if isinstance(value, float):
            writer.add_float32(f"{spec.arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{spec.arch}.{key}", value)
        else:
            writer.add_uint32(f"{spec.arch}.{key}", int(value))  # type: ignore[call-overload]
    vocab = _add_tokenizer(writer, spec.tokenizer)
    norm_center = 1.0  # the norms' weights (Gemma's stored as 1 + w: around 1 too)
    _tensor(writer, "token_embd.weight", (vocab, spec.hidden), spec.types.get("token_embd", "F32"), rng)
    _tensor(writer, "output_norm.weight", (spec.hidden,), "F32", rng, around=norm_center)
    if not spec.tied:
        _tensor(writer, "output.weight", (vocab, spec.hidden), spec.types.get("output", "Q8_0"), rng)
    for layer in range(spec.layers):
        for kind, shape in _layer_tensors(spec).items():
            name = f"blk.{layer}.{kind}.weight"
            if len(shape) == 1:
                _tensor(writer, name, shape, "F32", rng, around=norm_center)
            else:
                _tensor(writer, name, shape, spec.types.get(kind, "Q8_0"), rng)
        if spec.arch == "qwen2":
            for kind, rows in (("attn_q", spec.heads), ("attn_k", spec.kv_heads), ("attn_v", spec.kv_heads)):
                _tensor(writer, f"blk.{layer}.{kind}.bias", (rows * spec.head_dim,), "F32", rng)
    for name, values in spec.extra_tensors.items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
