"""IncrementalDetokenizer: streaming text equals a full decode, split characters are never shown,
and stop strings are found across tokens and updates without streaming any part of them."""

from __future__ import annotations

import random

import pytest

from asyncengine.errors import RequestError
from asyncengine.frontend.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feeds `ids` `chunk` at a time; returns the deltas (flush included) and the stop string."""
    deltas = []
    for i in range(0, len(ids), chunk):
        update = detok.update(ids[i : i + chunk])
        assert isinstance(update, DetokenizerUpdate)
        deltas.append(update.delta_text)
        if update.stop_str is not None:
            return deltas, update.stop_str
    deltas.append(detok.flush())
    return deltas, None


def char_boundaries(tokenizer, ids: list[int]) -> list[int]:
    """Positions k where ids[:k] ends on a whole character."""
    return [k for k in range(len(ids) + 1) if not tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR)]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- streaming reproduces a full decode ---------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
def test_bytelevel_stream_equals_decode(bytelevel_tokenizer, sample_texts, chunk):
    tok = bytelevel_tokenizer
    ids = encode(tok, " ".join(sample_texts))
    boundaries = char_boundaries(tok, ids)
    rng = random.Random(0)
    for _ in range(150):
        start = rng.choice(boundaries)  # a prompt ending inside a character is a separate case
        prompt_start = rng.randrange(0, start + 1)
        end = rng.randrange(start, min(start + 40, len(ids)) + 1)
        prompt, output = ids[prompt_start:start], ids[start:end]
        detok = IncrementalDetokenizer(tok, prompt)
        deltas, _ = stream(detok, output, chunk)
        full = tok.decode(output)
        # A request cut inside a character ends without the replacement character of its half.
        expected = full[:-1] if full.endswith(REPLACEMENT_CHAR) else full
        assert "".join(deltas) == expected == detok.output_text
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_split_characters_are_held_until_complete(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    text = "Emoji time 😀🎉👍🏽 and flags 🇫🇷"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, encode(tok, "Say:"))
    deltas = [detok.update([i]).delta_text for i in ids]
    assert "".join(deltas) + detok.flush() == text
    # Some token was only part of a character: its update showed nothing, a later one all of it.
    assert "" in deltas
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_random_ids_never_show_a_split_character(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    rng = random.Random(1)
    ids_pool = list(range(len(tok)))  # special tokens included: skipped, they add no text
    num_clean = 0
    for _ in range(3000):
        output = [rng.choice(ids_pool) for _ in range(rng.randrange(1, 10))]
        prompt = [rng.choice(ids_pool) for _ in range(rng.randrange(0, 4))]
        detok = IncrementalDetokenizer(tok, prompt)
        deltas, _ = stream(detok, output)
        full = tok.decode(output, skip_special_tokens=True)
        if REPLACEMENT_CHAR not in full:
            num_clean += 1
            assert "".join(deltas) == full
            assert not any(REPLACEMENT_CHAR in d for d in deltas)
        else:
            # Invalid bytes in the middle do show (as in a full decode); a trailing split does not.
            assert "".join(deltas) == full.rstrip(REPLACEMENT_CHAR)
    assert num_clean > 300  # the clean case was exercised often enough to mean something


@pytest.mark.parametrize("chunk", [1, 2])
def test_metaspace_stream_keeps_leading_spaces(metaspace_tokenizer, sample_texts, chunk):
    """A sentencepiece-style decoder drops the space in front of the first token it decodes. In
    context, that space belongs to the output: the stream must equal decode(prompt + output) with
    decode(prompt) removed, and decode(output) when there is no prompt."""
    tok = metaspace_tokenizer
    ids = encode(tok, " ".join(sample_texts))
    boundaries = char_boundaries(tok, ids)
    rng = random.Random(2)
    for _ in range(150):
        start = rng.choice(boundaries)
        prompt_start = rng.choice([k for k in boundaries if k <= start])
        end = rng.choice([k for k in boundaries if start <= k <= start + 30])
        prompt, output = ids[prompt_start:start], ids[start:end]
        deltas, _ = stream(IncrementalDetokenizer(tok, prompt), output, chunk)
        prompt_text, whole = tok.decode(prompt), tok.decode(prompt + output)
        assert whole.startswith(prompt_text)
        assert "".join(deltas) == whole[len(prompt_text) :]
        if not prompt:
            assert "".join(deltas) == tok.decode(output)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_metaspace_first_token_space(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt = encode(tok, "Hello")
    output = encode(tok, "Hello world")[len(prompt) :]
    assert tok.convert_ids_to_tokens(output[:1])[0].startswith("▁")
    assert tok.decode(output) == "world"  # what a decode of the output alone says
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt), output)
    assert "".join(deltas) == " world"  # what the user should see after "Hello"


def test_prompt_context_starting_inside_a_byte_fallback_character(metaspace_tokenizer):
    """Five prompt tokens back lands inside 東 (three <0xNN> tokens): decoded from there, the
    byte-fallback decoder garbles the whole byte run. The window backs up to the character's first
    byte, so the context decodes cleanly and the output keeps its leading space."""
    tok = metaspace_tokenizer
    prompt = encode(tok, "Mixed: naïve 東京")
    tokens = tok.convert_ids_to_tokens(prompt[-6:])
    assert tokens == ["<0xE6>", "<0x9D>", "<0xB1>", "<0xE4>", "<0xBA>", "<0xAC>"]
    output = encode(tok, "Mixed: naïve 東京 😀 café")[len(prompt) :]
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt), output)
    assert "".join(deltas) == " 😀 café"


def test_prompt_ending_inside_a_character(bytelevel_tokenizer):
    """Token-id prompts may cut a character in two; the output then decodes on its own."""
    tok = bytelevel_tokenizer
    ids = encode(tok, "flags 🇫🇷 and more")
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    deltas, _ = stream(IncrementalDetokenizer(tok, ids[:k]), ids[k:])
    assert "".join(deltas) == tok.decode(ids[k:])


# -- special tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(bytelevel_tokenizer, skip):
    tok = bytelevel_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    output = encode(tok, "Hi 😀") + [im_end] + encode(tok, " there") + [im_end]
    detok = IncrementalDetokenizer(tok, encode(tok, "<|im_start|>assistant\n"), skip_special_tokens=skip)
    deltas, _ = stream(detok, output)
    expected = "Hi 😀 there" if skip else "Hi 😀<|im_end|> there<|im_end|>"
    assert "".join(deltas) == expected == tok.decode(output, skip_special_tokens=skip)


# -- stop strings -------------------------------------------------------------------------------


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text a character-by-character stream would produce: the stop string completed
    first wins (ties: the one starting first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, s = min(found)
    return text[: end if include else start], s


@pytest.mark.parametrize("tokenizer_name", ["bytelevel_tokenizer", "metaspace_tokenizer"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_a_reference(request, sample_texts, tokenizer_name, include):
    """Random outputs, stop strings and update sizes: the streamed text equals the reference cut,
    and no update ever streams text that the final cut removes."""
    tok = request.getfixturevalue(tokenizer_name)
    ids = encode(tok, " ".join(sample_texts))
    boundaries = char_boundaries(tok, ids)
    rng = random.Random(3)
    num_stopped = 0
    for _ in range(200):
        start = rng.choice(boundaries)
        end = rng.choice([k for k in boundaries if start <= k <= start + 40])
        prompt_start = max(k for k in boundaries if k <= max(start - 6, 0))
        prompt, output = ids[prompt_start:start], ids[start:end]
        prompt_text = tok.decode(prompt)
        text = tok.decode(prompt + output)[len(prompt_text) :]
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if text and rng.random() < 0.7:
                i = rng.randrange(len(text))
                stops.append(text[i : i + rng.randrange(1, 8)])
            else:
                stops.append(rng.choice(["fox", "STOP", "\n\n", "😀", "é", "zzz", "。"]))
        expected, expected_stop = reference_stop(text, stops, include)
        detok = IncrementalDetokenizer(tok, prompt, stop=stops, include_stop_str_in_output=include)
        streamed, found, i = "", None, 0
        while i < len(output) and found is None:
            n = rng.randrange(1, 5)
            update = detok.update(output[i : i + n])
            i += n
            streamed += update.delta_text
            found = update.stop_str
            assert expected.startswith(streamed), (stops, streamed, expected)
        if found is None:
            streamed += detok.flush()
        assert (streamed, found) == (expected, expected_stop), stops
        assert detok.output_text == expected
        num_stopped += found is not None
    assert num_stopped > 50


def test_stop_string_inside_one_token(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    output = encode(tok, "Hello world, this is a test of the streaming detokenizer.")
    pieces = [tok.decode([i]) for i in output]
    stop = "ok"
    k = next(i for i, p in enumerate(pieces) if stop in p and p != stop)  # strictly inside "tok"
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    updates = [detok.update([i]) for i in output[: k + 1]]
    assert [u.stop_str for u in updates] == [None] * k + [stop]
    text = tok.decode(output)
    assert detok.output_text == text[: text.index(stop)] == "Hello world, this is a test of the streaming det"
    assert "".join(u.delta_text for u in updates) == detok.output_text


def test_stop_string_spanning_three_tokens(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    output = encode(tok, "The quick brown fox jumps over the lazy dog.")
    pieces = [tok.decode([i]) for i in output]
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i - 1] and pieces[i + 1])
    stop = pieces[k - 1][-1] + pieces[k] + pieces[k + 1][0]
    text = tok.decode(output)
    deltas, found = stream(IncrementalDetokenizer(tok, [], stop=[stop]), output)
    assert found == stop
    assert "".join(deltas) == text[: text.index(stop)]


def test_stop_string_starting_in_an_earlier_update(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    detok = IncrementalDetokenizer(tok, encode(tok, "Say it:"), stop=["STOP here"])
    first = detok.update(encode(tok, " fine. ST"))
    assert first == DetokenizerUpdate(" fine. ", None)  # "ST" may begin the stop string
    second = detok.update(encode(tok, "OP here, or"))
    assert second == DetokenizerUpdate("", "STOP here")
    assert detok.output_text == " fine. "


def test_earliest_stop_string_wins(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    output = encode(tok, "The quick brown fox jumps")
    detok = IncrementalDetokenizer(tok, [], stop=["fox", "quick", "jumps"])
    assert detok.update(output) == DetokenizerUpdate("The ", "quick")


def test_stop_string_completed_first_wins_when_nested(bytelevel_tokenizer):
    """"brown" starts first but "row" is complete first: one character at a time, "row" would
    have ended the request, so it wins however the tokens are grouped into updates."""
    tok = bytelevel_tokenizer
    output = encode(tok, "The quick brown fox")
    for chunk in (1, len(output)):
        deltas, found = stream(IncrementalDetokenizer(tok, [], stop=["brown", "row"]), output, chunk)
        assert (found, "".join(deltas)) == ("row", "The quick b")


def test_include_stop_str_in_output(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    output = encode(tok, "The quick brown fox jumps")
    detok = IncrementalDetokenizer(tok, [], stop=["fox", "brown f"], include_stop_str_in_output=True)
    deltas, found = stream(detok, output)
    assert found == "brown f"
    assert "".join(deltas) == "The quick brown f"
    # Nothing needs holding back: text up to the end of a match stays in the output.
    detok = IncrementalDetokenizer(tok, [], stop=["brown"], include_stop_str_in_output=True)
    assert detok.update(encode(tok, "The quick bro")).delta_text == "The quick bro"


def test_multibyte_stop_string_split_across_tokens(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    output = encode(tok, "flags 🇫🇷 and 🎉 party")
    deltas, found = stream(IncrementalDetokenizer(tok, [], stop=["🎉"]), output)
    assert (found, "".join(deltas)) == ("🎉", "flags 🇫🇷 and ")


def test_hold_back_until_disproved_and_flush(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=["STOP", "\n\nUser:"])
    # Text that cannot begin a stop string streams at once.
    assert detok.update(encode(tok, "Hello world")).delta_text == "Hello world"
    # A possible beginning is held...
    assert detok.update(encode(tok, ", ST")).delta_text == ", "
    assert detok.update(encode(tok, "O")).delta_text == ""
    # ...until the text proves it is not a stop string.
    assert detok.update(encode(tok, "rm")).delta_text == "STOrm"
    assert detok.update(encode(tok, "\n\nUs")).delta_text == ""
    # The request ends for another reason (length, EOS): flush releases what was held.
    assert detok.flush() == "\n\nUs"
    assert detok.output_text == "Hello world, STOrm\n\nUs"
    assert detok.flush() == ""


def test_flush_releases_text_of_a_token_ending_in_a_split_character(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    ids = encode(tok, "Emoji time 😀🎉")
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    detok = IncrementalDetokenizer(tok, [], stop=["xyz"])
    streamed = "".join(detok.update([i]).delta_text for i in ids[:k])
    expected = tok.decode(ids[:k])[:-1]
    assert streamed + detok.flush() == expected == detok.output_text


def test_prompt_never_matches_a_stop_string(bytelevel_tokenizer):
    tok = bytelevel_tokenizer
    detok = IncrementalDetokenizer(tok, encode(tok, "Never say fox or fo"), stop=["fox"])
    # "fo" ends the prompt and "x" begins the output: the prompt does not count.
    assert detok.update(encode(tok, "x fine")) == DetokenizerUpdate("x fine", None)
    assert detok.update(encode(tok, ", fox")) == DetokenizerUpdate(", ", "fox")


def test_empty_stop_string_is_a_request_error(bytelevel_tokenizer):
    with pytest.raises(RequestError) as info:
        IncrementalDetokenizer(bytelevel_tokenizer, [], stop=["ok", ""])
    assert info.value.field == "stop"
    assert "non-empty" in str(info.value)
    # A lone string is one stop string (as in SamplingParams), not one per character.
    assert IncrementalDetokenizer(bytelevel_tokenizer, [], stop="fox").stop == ("fox",)


# -- cost ---------------------------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decode_window_stays_small(bytelevel_tokenizer, sample_texts):
    counting = CountingTokenizer(bytelevel_tokenizer)
    ids = encode(bytelevel_tokenizer, " ".join(sample_texts * 20))
    detok = IncrementalDetokenizer(counting, list(range(100)), stop=["never-seen"])
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == bytelevel_tokenizer.decode(ids)
    assert len(ids) > 1000
    # The window is the last chunk of emitted tokens plus those still waiting; it is longest
    # where consecutive tokens each end inside a character (the ZWJ family emoji here).
    assert max(counting.lengths) <= 12
    assert sum(counting.lengths) / len(counting.lengths) < 3
    assert len(counting.lengths) <= 2 * len(ids) + 2
