"""A GGUF file's tokenizer, as the converted directory's tokenizer files (loader/gguf.py).

The file holds its tokenizer as metadata (`tokenizer.ggml.model`: `gpt2` for byte-level BPE as Qwen and SmolLM
have, `llama` for SentencePiece-style vocabularies as Gemma, Mistral and Phi-3 have; the tokens, scores, token
types, merges, special ids and chat template). transformers builds a tokenizer from exactly that
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, with per-architecture fixes for Gemma and Phi-3), and we
use that builder rather than keep a second one: it is the reference the engine must agree with. The converter
saves what it builds as tokenizer.json and its configuration, reloads the saved files the way the engine will,
and checks that they give the same ids as the GGUF-built tokenizer on `CHECK_TEXTS` and the same chat prompt.
Building a large SentencePiece vocabulary this way is slow (Gemma 3's 262k tokens: about 30 s, merges derived
from the vocabulary); it happens once, in the conversion, which is cached.
"""

from __future__ import annotations

from pathlib import Path

from asyncengine.errors import ModelLoadError

# Texts whose ids must survive the save: spaces at the start and in runs, newlines and tabs, digits, code,
# accents, CJK and emoji (byte fallback), the chat markers of the common templates.
CHECK_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,   three inside\n\nand\ttabs\r\n",
    "1234567890 3.14159 -42 1e-9",
    "def f(x):\n    return x ** 2  # square\n",
    "héllo wörld ñandú çà 世界 こんにちは 🙂🚀",
    "<|im_start|>user\nwhat's 2+2?<|im_end|> <start_of_turn>model\n<end_of_turn> [INST] hi [/INST] <|user|>",
    "",
)


def save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except ValueError as exc:
            if "is not supported yet" not in str(exc):
                raise
            # transformers reads the model's config first and refuses an architecture it has no GGUF reader for
            # (`olmoe`); its tokenizer builder reads only `tokenizer.ggml.*`, the same for every architecture.
            tok = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{gguf_path}: transformers cannot build a tokenizer from this GGUF file's metadata "
                             f"({type(exc).__name__}: {exc}); pass --tokenizer DIR with the model's own "
                             "tokenizer files") from exc
    # transformers copies tokenizer.chat_template from the GGUF; set it anyway so that a change
    # there cannot drop it silently, then check it survives the save/load round trip.
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if reloaded.chat_template != chat_template:
        raise ModelLoadError(f"{gguf_path}: the chat template did not survive saving the tokenizer to {out_dir}")
    differing = [text for text in CHECK_TEXTS if reloaded.encode(text) != tok.encode(text)]
    if not differing and chat_template is not None:
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
        if reloaded.apply_chat_template(chat, tokenize=False) != tok.apply_chat_template(chat, tokenize=False):
            differing.append("(the chat template's rendering)")
    if differing:
        raise ModelLoadError(f"{gguf_path}: the tokenizer saved in {out_dir} differs from the GGUF one on "
                             f"{differing[0]!r}")
