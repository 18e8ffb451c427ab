"""Incremental detokenization with stop strings, for streaming.

The frontend turns each batch of newly sampled token ids into the text that is safe to show now.
Two things make that harder than `tokenizer.decode(new_ids)`:

* Decoding is context dependent. A sentencepiece-style decoder drops the leading space of the
  first token it sees, and a byte-level token may carry half of a UTF-8 character. We therefore
  decode a small sliding window of tokens twice (with and without the new tokens) and emit the
  difference, holding everything back while the text ends in a split character.
* Stop strings may span tokens and updates. We search only the new text (plus enough old text
  for a match that started earlier), and never stream a suffix that could still turn out to be
  the beginning of a stop string.

Each update costs O(window + longest stop string), never O(text so far).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from asyncengine.errors import RequestError

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# How many prompt tokens the window starts with. The first generated token must be decoded in
# context (so a "▁word" piece keeps its space); a few tokens is plenty and keeps decoding cheap.
# Same choice as vLLM.
PROMPT_CONTEXT_TOKENS = 5

# A byte-level (or byte-fallback) decoder renders an incomplete UTF-8 sequence as this character.
REPLACEMENT_CHAR = "\ufffd"


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one `IncrementalDetokenizer.update` produced."""

    delta_text: str
    """New text, safe to stream now."""
    stop_str: str | None = None
    """The stop string that was found; the text is already cut there and the request should end."""


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text, one request at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: str | Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        # A lone string is one stop string, not a list of one-character ones.
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in self.stop):
            # "" would match everywhere and end every request before its first character.
            raise RequestError("stop strings must be non-empty", field="stop")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_str: str | None = None
        """The stop string that ended the text, once one has been found (by update or flush)."""

        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            # Fast tokenizers ignore it (their Rust decoder decides); others may honour it.
            "spaces_between_special_tokens": spaces_between_special_tokens,
            # The clean-up (" ." -> ".", " n't" -> "n't", ...) can rewrite text across token
            # boundaries, i.e. text we already streamed; it is not incremental, so it stays off,
            # as in vLLM's streaming detokenizer.
            "clean_up_tokenization_spaces": False,
        }

        # The sliding window: `_window` holds the ids from the prefix offset on; `_read` is the
        # read offset inside it. `_window[:_read]` is context whose text was already emitted, and
        # `_prefix_text` caches its decoding.
        self._window, self._prefix_text = self._prompt_context(list(prompt_token_ids))
        self._read = len(self._window)

        # Stop-string state. `_tail` is the end of the text decoded so far, just long enough to
        # hold a stop string minus its last character: a match completed by new text can start
        # no earlier. `_held` is decoded text not yet released (a possible stop-string start).
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stop_first_chars = frozenset(s[0] for s in self.stop)
        self._tail = ""
        self._held = ""
        self._emitted: list[str] = []
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far (joined on demand: appending to one str would cost O(n))."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def update(self, new_token_ids: Iterable[int], *, check_stop: bool = True) -> DetokenizerUpdate:
        """Takes the newly generated token ids; returns the text to stream and any stop string.

        With `check_stop=False` (the request has not reached min_tokens yet) stop strings that end
        in this update do not count, as in vLLM.
        """
        if self._finished:
            # A stop string ended the request, or flush() was called; nothing more to say.
            return DetokenizerUpdate("")
        new_text = "".join([self._decode_next(token_id) for token_id in new_token_ids])
        return self._release(new_text, final=False, check_stop=check_stop)

    def flush(self) -> str:
        """Ends the request: returns the text held back so far (the request ended another way)."""
        if self._finished:
            return ""
        # Text of tokens still waiting for the rest of a character: keep what precedes the
        # incomplete character (so the output matches a full decode up to it) and drop the
        # replacement character itself, which would only show a split sequence.
        pending = self._decode(self._window)[len(self._prefix_text) :].rstrip(REPLACEMENT_CHAR)
        return self._release(pending, final=True).delta_text

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, **self._decode_kwargs)

    def _prompt_context(self, prompt: list[int]) -> tuple[list[int], str]:
        """Chooses the prompt tokens the window starts with, and decodes them."""
        start = max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0)
        text = self._decode(prompt[start:])
        # A window that starts inside a character decodes it as garbage, and a byte-fallback
        # decoder (<0xNN> tokens) then garbles the whole run of byte tokens, the prompt's last
        # character included. Back up to the character's first token: a UTF-8 character has at
        # most 4 bytes, so at most 3 more tokens.
        lowest = max(start - 3, 0)
        while start > lowest and text.startswith(REPLACEMENT_CHAR):
            start -= 1
            text = self._decode(prompt[start:])
        if text.endswith(REPLACEMENT_CHAR):
            # The prompt itself ends inside a character (ids cut mid-character). Its bytes would
            # merge with the first generated ones and throw off the text-length arithmetic;
            # decode the output on its own instead, as `tokenizer.decode(output_ids)` does.
            return [], ""
        return prompt[start:], text

    def _decode_next(self, token_id: int) -> str:
        """Adds one token to the window; returns the text it completes (maybe empty)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._prefix_text):
            # A character is still split across tokens, or the token added no text yet (a
            # skipped special token, a lone "▁" at the start): wait for more tokens.
            return ""
        delta = text[len(self._prefix_text) :]
        # Slide: the tokens just read become the context for the next ones, and the window
        # drops what came before them, so it stays a handful of tokens long.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    # -- stop strings and hold-back -----------------------------------------------------------

    def _release(self, new_text: str, *, final: bool, check_stop: bool = True) -> DetokenizerUpdate:
        """Searches `new_text` for stop strings and releases what is safe to stream."""
        if final:
            self._finished = True
        if not new_text and not final:
            return DetokenizerUpdate("")
        unreleased = self._held + new_text
        stop = self._find_stop(new_text)  # always run: it also keeps the search tail current
        if stop is not None and check_stop:
            stop_str, cut = stop  # `cut` counts characters from the end of `unreleased`
            self.stop_str = stop_str
            self._finished = True
            self._held = ""
            return self._emit(unreleased[: len(unreleased) - cut], stop_str)
        if final:
            self._held = ""
            return self._emit(unreleased, None)
        num_held = self._num_to_hold(unreleased)
        self._held = unreleased[len(unreleased) - num_held :]
        return self._emit(unreleased[: len(unreleased) - num_held], None)

    def _emit(self, text: str, stop_str: str | None) -> DetokenizerUpdate:
        if text:
            self._emitted.append(text)
        return DetokenizerUpdate(text, stop_str)

    def _find_stop(self, new_text: str) -> tuple[str, int] | None:
        """Finds the stop string completed first in `new_text`.

        Returns the stop string and where to cut, as a count of characters from the end of the
        text. The match that ends first wins (ties: the one starting first), which is what a
        character-by-character stream would see, so the result does not depend on how tokens
        were grouped into updates. Only the new text and the tail before it are searched.
        """
        if not self.stop or not new_text:
            return None
        region = self._tail + new_text
        new_start = len(self._tail)
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            # A match must end inside the new text, or we would have found it before.
            start = region.find(s, max(new_start - len(s) + 1, 0))
            if start != -1 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        keep = self._max_stop_len - 1
        self._tail = region[max(len(region) - keep, 0) :]
        if best is None:
            return None
        end, start, s = best
        cut_at = end if self.include_stop_str_in_output else start
        return s, len(region) - cut_at

    def _num_to_hold(self, text: str) -> int:
        """How many trailing characters of `text` could still begin a stop string.

        That is the longest suffix which is a proper prefix of some stop string; at most the
        longest stop string minus one. With include_stop_str_in_output nothing is held: a match
        ends in new text and the output keeps everything up to its end, so streamed text is never
        taken back.
        """
        if not self.stop or self.include_stop_str_in_output:
            return 0
        first = max(len(text) - self._max_stop_len + 1, 0)
        for i in range(first, len(text)):  # longest suffix first
            if text[i] not in self._stop_first_chars:
                continue
            suffix = text[i:]
            if any(len(s) > len(suffix) and s.startswith(suffix) for s in self.stop):
                return len(text) - i
        return 0
