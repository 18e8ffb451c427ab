"""The model family's own tokenizer mode, `example_bytes`: UTF-8 bytes as token ids, shifted past a
few special ids. Registered by the general plugin with TokenizerRegistry (EXTENSION_POINTS.md R9) and
chosen with `--tokenizer-mode example_bytes`; only the frontend builds and calls it (the engine core and
the workers see token ids only).

Built as `ExampleByteTokenizer.from_pretrained(path)`, as every tokenizer mode is; this one needs no
files, so `path` is only recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from ae_model_example._record import record

__all__ = ["TOKENIZER_MODE", "ExampleByteTokenizer"]

TOKENIZER_MODE = "example_bytes"


class ExampleByteTokenizer:
    bos_token_id = 1
    eos_token_id = 2
    offset = 3  # ids 0-2 are special; byte b is id b + 3, so the vocabulary needs 259 ids

    @classmethod
    def from_pretrained(cls, path: str) -> ExampleByteTokenizer:
        record("tokenizer built", mode=TOKENIZER_MODE, path=str(path))
        return cls()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [byte + self.offset for byte in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_ignored: object) -> str:
        # Keywords the engine passes for transformers' tokenizers (spaces_between_special_tokens, ...) mean
        # nothing for bytes. Special ids, and ids past the byte range that a random model may emit, decode
        # to nothing when skipped and to a visible marker otherwise; a cut UTF-8 sequence decodes to "\ufffd",
        # which the streaming detokenizer holds back until the character is whole.
        data = bytearray()
        text = []
        for token_id in ids:
            byte = token_id - self.offset
            if 0 <= byte < 256:
                data.append(byte)
                continue
            text.append(data.decode("utf-8", errors="replace"))
            data.clear()
            if not skip_special_tokens:
                text.append(f"<{token_id}>")
        text.append(data.decode("utf-8", errors="replace"))
        return "".join(text)
