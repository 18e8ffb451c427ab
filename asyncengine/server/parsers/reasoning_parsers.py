"""Reasoning parsers: split a model's text into its reasoning and its answer (the response's
`reasoning`, also sent as `reasoning_content`, and `content`), whole or while it streams.

`ReasoningParserManager` maps a name (`--reasoning-parser NAME`) to a ReasoningParser class; plugins
add to it with `@ReasoningParserManager.register_module("name")`, loaded with
`--reasoning-parser-plugin`. Both are in the floor (asyncengine.interfaces.parsers); this module holds
the built-in parsers, which the floor's table names by path.

Built in (vLLM's names):
- `think`: `<think>...</think>`; an output without any tag is content.
- `deepseek_r1`: `<think>...</think>` where the template opened the tag (DeepSeek-R1, QwQ): an output
  without `</think>` is all reasoning (it was cut off while thinking).
- `qwen3`: as deepseek_r1, but with `chat_template_kwargs` `{"enable_thinking": false}` the template
  closed the think block in the prompt, so the whole output is content.
- `granite`: IBM Granite 3.2's "Here is my thought process:" ... "Here is my response:".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The base class and the table are in the floor (a plugin subclasses and fills them).
from asyncengine.interfaces.parsers import DeltaMessage, ReasoningParser
from asyncengine.server.parsers.incremental import NOTHING, Split, SplitReasoningParser
from asyncengine.server.parsers.text_scan import find_marker, partial_marker_length, skip_space
from asyncengine.server.parsers.tool_parsers import partial_tag_length


# -- think ----------------------------------------------------------------------------------------

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser(ReasoningParser):
    """Reasoning inside `<think>...</think>`, where the opening tag may be missing.

    Many chat templates put `<think>` into the prompt, so the model's output starts inside the
    reasoning and only `</think>` shows. Hence, for a complete output:
    - `</think>` present: before it is reasoning (less a leading `<think>`), after it is content;
    - only a leading `<think>`: all after it is reasoning, content None (the model never finished);
    - no tag at all: all of it is content.
    Only a `<think>` at the very start (whitespace aside) opens reasoning; elsewhere it is text.

    Streaming sends text as reasoning until `</think>`, then as content, holding back what could be
    the start of a tag and never sending the tags. It cannot know, while a tagless output streams,
    that no `</think>` will come, so such an output streams as reasoning although extract_reasoning
    calls it content. Text held back when the stream ends (a partial tag) is never sent.
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._position = 0  # how much of current_text is dealt with
        self._mode = "start"  # "start" (an opening tag may come) | "reasoning" | "content"

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        head, closed, tail = model_output.partition(THINK_END)
        if closed:
            return self._without_opening_tag(head) or None, tail or None
        if model_output.lstrip().startswith(THINK_START):
            return self._without_opening_tag(model_output) or None, None
        return None, model_output or None

    @staticmethod
    def _without_opening_tag(text: str) -> str:
        stripped = text.lstrip()
        return stripped[len(THINK_START):] if stripped.startswith(THINK_START) else text

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        # Work from current_text and our own position rather than delta_text, so held-back text and
        # however the route splits deltas make no difference.
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            rest = current_text[self._position:]
            if self._mode == "start":
                begun = rest.lstrip()
                if not begun or (len(begun) < len(THINK_START) and THINK_START.startswith(begun)):
                    break  # only whitespace, or the start of what may be an opening tag: wait
                if begun.startswith(THINK_START):
                    self._position += len(rest) - len(begun) + len(THINK_START)
                self._mode = "reasoning"  # with or without the opening tag, reasoning comes first
            elif self._mode == "reasoning":
                end = rest.find(THINK_END)
                if end == -1:
                    sendable = len(rest) - partial_tag_length(rest, THINK_END)
                    reasoning.append(rest[:sendable])
                    self._position += sendable
                    break
                reasoning.append(rest[:end])
                self._position += end + len(THINK_END)
                self._mode = "content"
            else:
                content.append(rest)
                self._position = len(current_text)
                break
        reasoning_text, content_text = "".join(reasoning), "".join(content)
        if not reasoning_text and not content_text:
            return None
        return DeltaMessage(reasoning_content=reasoning_text or None, content=content_text or None)

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """`</think>` after the last `<think>` of these tokens' text. On text, not on one token id: in a model
        without a `</think>` token the tag's tokens depend on what precedes it."""
        if self.tokenizer is None:
            raise ValueError("the think reasoning parser needs the tokenizer to find </think> in token ids")
        text = self.tokenizer.decode(token_ids)
        return text.rfind(THINK_END) > text.rfind(THINK_START)


def _decoded(parser: ReasoningParser, token_ids: list[int]) -> str:
    if parser.tokenizer is None:
        raise ValueError(f"the {type(parser).__name__} needs the tokenizer to read the reasoning's end in token ids")
    return parser.tokenizer.decode(token_ids)


# -- deepseek_r1, qwen3 -----------------------------------------------------------------------------------

class DeepSeekR1ReasoningParser(SplitReasoningParser):
    """`<think>...</think>` where the chat template put `<think>` into the prompt (DeepSeek-R1, QwQ).

    The output starts inside the reasoning: before `</think>` is reasoning, after it content. A
    leading `<think>` (templates that leave it to the model) is dropped; one elsewhere is text. With no
    `</think>` the model never finished thinking (it was cut off): all is reasoning, content None. A
    stream holds back only what could be the start of a tag.
    """

    def split(self, text: str, request: Any, final: bool) -> Split:
        begun = skip_space(text, 0)
        if not final and is_proper_prefix(text, begun, THINK_START):
            return NOTHING, NOTHING  # only whitespace, or what may become the opening tag: wait
        body = begun + len(THINK_START) if text.startswith(THINK_START, begun) else 0
        end = self.find(text, THINK_END, body)
        if end != -1:
            return (body, end), (end + len(THINK_END), len(text))
        return (body, open_end(text, body, final, (THINK_END,))), NOTHING

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """`</think>` after the last `<think>` in these tokens' text (on text: see the think parser)."""
        text = _decoded(self, token_ids)
        return text.rfind(THINK_END) > text.rfind(THINK_START)


QWEN3_TOOL_CALL = "<tool_call>"
QWEN3_FUNCTION = "<function="


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """Qwen3's thinking: `<think>...</think>` as deepseek_r1 reads it, switched by the request's
    `chat_template_kwargs` `enable_thinking` (default on).

    Off: Qwen3's template writes an empty think block into the prompt, so the output is all content
    (even a `</think>` in it). On: as deepseek_r1, and (as vLLM, for Qwen3.5 and Qwen3-Coder, which
    may call a tool without closing their thinking) a `<tool_call>` followed by `<function=` ends the
    reasoning: the call is content, for the tool parser.
    """

    def split(self, text: str, request: Any, final: bool) -> Split:
        if not thinking_enabled(request):
            return NOTHING, (0, len(text))
        reasoning, content = super().split(text, request, final)
        if content != NOTHING or reasoning == NOTHING or self.find(text, THINK_END, reasoning[0]) != -1:
            return reasoning, content
        cut, confirmed = _implicit_end(text, reasoning, final, self.find)
        return (reasoning[0], cut), ((cut, len(text)) if confirmed else NOTHING)

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        text = _decoded(self, token_ids)
        end = max(text.rfind(THINK_END), _last_implicit_end(text))
        return end > text.rfind(THINK_START)


def thinking_enabled(request: Any) -> bool:
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    return kwargs.get("enable_thinking", True) is not False


def _implicit_end(text: str, reasoning: tuple[int, int], final: bool,
                  find: Callable[[str, str, int], int]) -> tuple[int, bool]:
    """Where still-open reasoning ends: (index, True) at a `<tool_call>` that opens a function call;
    while streaming, (index, False) at one not yet followed far enough to tell, or at what may become
    one, which is held back; else (the reasoning's end, False). `find`: the parser's."""
    position = reasoning[0]
    while (start := find(text, QWEN3_TOOL_CALL, position)) != -1:
        after = skip_space(text, start + len(QWEN3_TOOL_CALL))
        if text.startswith(QWEN3_FUNCTION, after):
            return start, True
        if not final and (after == len(text) or is_proper_prefix(text, after, QWEN3_FUNCTION)):
            return start, False
        position = start + 1
    return open_end(text, reasoning[0], final, (QWEN3_TOOL_CALL,), end=reasoning[1]), False


def _last_implicit_end(text: str) -> int:
    start = text.rfind(QWEN3_TOOL_CALL)
    if start != -1 and text.startswith(QWEN3_FUNCTION, skip_space(text, start + len(QWEN3_TOOL_CALL))):
        return start
    return -1


# -- granite ----------------------------------------------------------------------------------------------

GRANITE_THOUGHT = ("Here is my thought process:", "Here's my thought process:")
GRANITE_RESPONSE = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(SplitReasoningParser):
    """IBM Granite 3.2 with `chat_template_kwargs` `{"thinking": true}`: "Here is my thought process:"
    (or "Here's ...") opens the reasoning, "Here is my response:" opens the content; neither phrase is
    sent. An output that does not open with the first phrase is all content. Without the second phrase
    the model never finished thinking: all after the first is reasoning (vLLM calls such an output
    content; here it is what a stream of it shows, reasoning).
    """

    def split(self, text: str, request: Any, final: bool) -> Split:
        begun = skip_space(text, 0)
        opening = next((phrase for phrase in GRANITE_THOUGHT if text.startswith(phrase, begun)), None)
        if opening is None:
            if not final and any(is_proper_prefix(text, begun, phrase) for phrase in GRANITE_THOUGHT):
                return NOTHING, NOTHING  # may still become the opening phrase: wait
            return NOTHING, (0, len(text))
        body = begun + len(opening)
        found = find_marker(text, body, GRANITE_RESPONSE, self._memo if self._streaming else None)
        if found is not None:
            return (body, found[0]), (found[0] + len(found[1]), len(text))
        return (body, open_end(text, body, final, GRANITE_RESPONSE)), NOTHING

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """The response phrase after the last thought phrase; with no thought phrase, no reasoning (so a
        constraint starts at once: Granite's thinking and a constrained answer do not mix)."""
        text = _decoded(self, token_ids)
        thought = max(text.rfind(phrase) for phrase in GRANITE_THOUGHT)
        return thought == -1 or max(text.rfind(phrase) for phrase in GRANITE_RESPONSE) > thought


def is_proper_prefix(text: str, start: int, word: str) -> bool:
    """Whether the text from `start` to its end is a beginning of `word` and shorter than it."""
    return len(text) - start < len(word) and word.startswith(text[start:])


def open_end(text: str, start: int, final: bool, markers: tuple[str, ...], end: int | None = None) -> int:
    """Where an open span from `start` ends: at `end` (the text's end by default), less, while
    streaming, what could be the start of one of `markers` there."""
    end = len(text) if end is None else end
    if final:
        return end
    return end - min(partial_marker_length(text[max(start, end - 32):end], markers), end - start)
