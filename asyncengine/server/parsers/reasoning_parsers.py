"""Reasoning parsers: split a model's text into its reasoning and its answer (OpenAI-style
`reasoning_content` and `content`), whole or while it streams.

`ReasoningParserManager` maps a name (`--reasoning-parser NAME`) to a ReasoningParser class; plugins
add to it with `@ReasoningParserManager.register_module("name")`, loaded with
`--reasoning-parser-plugin`. Both are in the floor (asyncengine.interfaces.parsers); this module holds
the built-in parser, which the floor's table names by path.

Built in: `think`, for models that reason inside `<think>...</think>` (DeepSeek-R1, Qwen3, QwQ, ...).
"""

from __future__ import annotations

from typing import Any

# The base class and the table are in the floor (a plugin subclasses and fills them); imported here
# for the names code and plugins have used.
from asyncengine.interfaces.parsers import DeltaMessage, ReasoningParser, ReasoningParserManager
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
