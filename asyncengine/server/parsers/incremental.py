"""Parsers written once for both ways of answering: a parser reads what a text says so far (`scan`), and
this module turns that into a whole response's content and tool calls, or into a stream's deltas.

A scan of a text that is still growing reports only what no continuation can change: content the
model has finished writing outside any call, each call's name once complete, the part of its
arguments' JSON text that is already final. So a later scan extends an earlier one, and a stream sends
the difference: content as it comes, each call's id, type and name once, then its arguments' JSON in
fragments (OpenAI's shape) that add up to the whole response's `arguments`.

What a stream cannot take back: when a text turns out not to be what the format expects (say, a
call's JSON breaks), the whole response is plain content, while a stream has sent the calls before
the break; it sends the rest of the text as content from there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncengine.interfaces.parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ReasoningParser,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)
from asyncengine.server.parsers.text_scan import (
    MalformedText,
    find_growing,
    find_marker,
    partial_marker_length,
    skip_space,
)


@dataclass
class ScannedCall:
    name: str | None = None  # None until the name is complete
    arguments: str = ""  # the arguments' JSON text known to be final so far
    complete: bool = False  # the call has ended and `arguments` is its whole JSON object


@dataclass
class ToolScan:
    """What a text says so far: content spans (start, end) in text order, calls, and where the text
    stopped making sense as the format (None while it does)."""

    content: list[tuple[int, int]] = field(default_factory=list)
    calls: list[ScannedCall] = field(default_factory=list)
    failed_at: int | None = None
    reading_from: int = 0  # where the call being read begins: where the text broke, if it does
    # How far long values were read (text_scan.json_value_end's memo): a stream's persists across its
    # scans, so a long argument is read once, piece by piece, not again on every delta.
    memo: dict[Any, Any] = field(default_factory=dict)

    def add_content(self, start: int, end: int) -> None:
        if end > start:
            self.content.append((start, end))

    def ended_early(self, final: bool) -> None:
        """The text stops inside a call: wait for more, or, when no more will come, not a call."""
        if final:
            raise MalformedText("the output ends inside a tool call")


# -- reading helpers shared by the formats -----------------------------------------------------------------

def add_leading_content(text: str, scan: ToolScan, final: bool, markers: tuple[str, ...]) -> None:
    """No call yet: the text is content, but for what could begin one of `markers` at its end."""
    scan.add_content(0, len(text) if final else len(text) - partial_marker_length(text, markers))


def content_up_to(text: str, scan: ToolScan, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The text before the first of `markers` is content: (where that marker begins, which it is); None
    when none occurs (the caller decides what the text is then)."""
    found = find_marker(text, 0, markers, scan.memo)
    if found is not None:
        scan.add_content(0, found[0])
        scan.reading_from = found[0]
    return found


def add_trailing_content(text: str, position: int, scan: ToolScan, final: bool, markers: tuple[str, ...] = ()) -> None:
    """Text after the calls is content, from its first non-space character; while streaming, what could
    begin one of `markers` is held back."""
    start = skip_space(text, position)
    end = len(text) if final else len(text) - partial_marker_length(text[start:], markers)
    scan.add_content(start, end)


def read_list(text: str, start: int, scan: ToolScan, final: bool, read_item: Callable[[int], int | None]) -> int | None:
    """Items separated by commas from `start` (just after a "[") to the "]": where the list ends, or None
    while it has not. `read_item(position)` reads one item: where it ends, or None while it has not."""
    position = start
    while True:
        position = skip_space(text, position)
        if position >= len(text):
            break
        if text[position] == "]":
            return position + 1
        end = read_item(position)
        if end is None:
            break
        position = skip_space(text, end)
        if position >= len(text):
            break
        if text[position] == ",":
            position += 1
        elif text[position] != "]":
            raise MalformedText(f"expected ',' or ']' after a call, at {position}")
    scan.ended_early(final)
    return None


def read_marked_blocks(text: str, scan: ToolScan, final: bool, opening: str, closing: str,
                       read_block: Callable[[int], int | None]) -> None:
    """Calls in `opening` ... `closing` blocks, content around them (after a call, from its first
    non-space character). `read_block(position)` reads a block's call from after the opening marker
    (and space): where it ends, or None while it has not. The closing marker may be missing at the end
    of the output (it is a stop token in some configurations)."""
    position = 0
    while True:
        content_start = skip_space(text, position) if scan.calls else position
        found = find_growing(text, opening, position, scan.memo)
        if found == -1:
            held = 0 if final else partial_marker_length(text[content_start:], (opening,))
            scan.add_content(content_start, len(text) - held)
            return
        scan.add_content(content_start, found)
        scan.reading_from = found
        end = read_block(skip_space(text, found + len(opening)))
        if end is None:
            scan.ended_early(final)
            return
        position = skip_space(text, end)
        if text.startswith(closing, position):
            position += len(closing)
        elif position < len(text) and not closing.startswith(text[position:]):
            raise MalformedText(f"expected {closing} after a call")
        elif not final:
            return  # the closing marker may be coming


# -- the parsers' base classes ------------------------------------------------------------------------------

class IncrementalToolParser(ToolParser):
    """A tool parser defined by `scan`; whole and streamed extraction come from it."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._content_position = 0  # the text up to here is dealt with as content
        self._arguments_sent: list[str] = []  # per call index: the arguments sent so far
        self._plain_from: int | None = None  # set once the text broke: all from here is content
        self._memo: dict[Any, Any] = {}  # the stream's ToolScan.memo
        self._seen = ""  # the stream's text at the last scan: the memo holds for texts that extend it

    def scan(self, text: str, request: Any, final: bool, memo: dict[Any, Any] | None = None) -> ToolScan:
        """What `text` says; `final`: no more will come (a call left unfinished then breaks the text)."""
        scan = ToolScan(memo={} if memo is None else memo)
        try:
            self.read(text, request, final, scan)
        except MalformedText:
            scan.failed_at = scan.reading_from
        return scan

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        """Fill `scan` from `text`, setting `scan.reading_from` as each call begins; MalformedText where
        the text cannot be the format."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_tool_call_id()

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        scan = self.scan(model_output, request, final=True)
        if scan.failed_at is not None or not scan.calls or not all(c.complete and c.name for c in scan.calls):
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        content = "".join(model_output[start:end] for start, end in scan.content).strip()
        calls = [ToolCall(id=self.new_call_id(), function=FunctionCall(name=call.name or "", arguments=call.arguments))
                 for call in scan.calls]
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=content or None)

    def adjust_request(self, request: Any) -> Any:
        """Keep special tokens in the output when tools may be called: most formats mark their calls
        with special tokens ([TOOL_CALLS], <|python_tag|>, ...), which detokenizing would drop."""
        if getattr(request, "tools", None) and getattr(request, "tool_choice", None) != "none":
            request.skip_special_tokens = False
        return request

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        if self._plain_from is not None:
            rest = current_text[self._plain_from:]
            self._plain_from = len(current_text)
            return DeltaMessage(content=rest) if rest else None
        if not current_text.startswith(self._seen):
            self._memo = {}  # not the text the memo was read from (the route only ever extends it)
        self._seen = current_text
        scan = self.scan(current_text, request, final=False, memo=self._memo)
        content: list[str] = []
        for start, end in scan.content:
            if end > self._content_position:
                content.append(current_text[max(start, self._content_position):end])
                self._content_position = end
        tool_calls = self._call_deltas(scan.calls)
        if scan.failed_at is not None:
            # Not the format after all: the rest goes out as the model wrote it. Before any call was
            # sent, that is all the text not yet sent, so the stream adds up to the whole response.
            start = self._content_position if not self._arguments_sent else max(self._content_position, scan.failed_at)
            content.append(current_text[start:])
            self._plain_from = len(current_text)
        text = "".join(content)
        if not text and not tool_calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=tool_calls or None)

    def _call_deltas(self, calls: list[ScannedCall]) -> list[DeltaToolCall]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls go out in order, each once its name is known
            if index == len(self._arguments_sent):
                self._arguments_sent.append(call.arguments)
                deltas.append(DeltaToolCall(index=index, id=self.new_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            sent = self._arguments_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._arguments_sent[index] = call.arguments
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=call.arguments[len(sent):])))
        return deltas


Split = tuple[tuple[int, int], tuple[int, int]]  # the (start, end) of the reasoning and of the content
NOTHING = (0, 0)


class SplitReasoningParser(ReasoningParser):
    """A reasoning parser defined by `split`; whole and streamed extraction come from it."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        # A stream's progress: where each part begins in the text and how much of it went out.
        self._sent = [(0, 0), (0, 0)]  # (start, length sent) for the reasoning, then the content
        self._memo: dict[Any, Any] = {}  # the stream's searches (text_scan.find_growing)
        self._seen = ""  # the stream's text at the last split: the memo holds for texts that extend it
        self._streaming = False

    def split(self, text: str, request: Any, final: bool) -> Split:
        """Where the reasoning and the content of `text` are (NOTHING for an empty part); while not
        `final`, only what no continuation can change: a later text's parts extend these."""
        raise NotImplementedError

    def find(self, text: str, marker: str, start: int) -> int:
        """`text.find(marker, start)`, for `split`: while streaming, resuming the stream's earlier search."""
        return find_growing(text, marker, start, self._memo if self._streaming else None)

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        (reasoning_start, reasoning_end), (content_start, content_end) = self.split(model_output, request, final=True)
        return (model_output[reasoning_start:reasoning_end] or None, model_output[content_start:content_end] or None)

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any
    ) -> DeltaMessage | None:
        if not current_text.startswith(self._seen):
            self._memo = {}  # not the text the memo was read from (the route only ever extends it)
        self._seen, self._streaming = current_text, True
        try:
            parts = self.split(current_text, request, final=False)
        finally:
            self._streaming = False
        new = [self._advance(index, current_text, span) for index, span in enumerate(parts)]
        if not any(new):
            return None
        return DeltaMessage(reasoning=new[0] or None, content=new[1] or None)

    def _advance(self, index: int, text: str, span: tuple[int, int]) -> str:
        """The part's text not sent yet (only what it adds: a split never takes text back)."""
        start, end = span
        sent_start, sent = self._sent[index]
        if end - start <= sent:
            return ""
        if sent and start != sent_start:
            return ""  # the part moved: nothing that extends what went out
        self._sent[index] = (start, end - start)
        return text[start + sent:end]
