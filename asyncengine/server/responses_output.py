"""A response's output items, built from the chat machinery's deltas (reasoning, content, tool calls),
with the stream events OpenAI sends for them.

One builder serves both shapes: a stream feeds it each chunk's delta as it comes and sends the events;
a whole response feeds it one delta holding the whole parse and keeps only the items. The items come in
the order the text has them, one open at a time, each announced, filled and closed as OpenAI's stream
does it:

- reasoning: output_item.added, content_part.added (reasoning_text), reasoning_text.delta...,
  reasoning_text.done, content_part.done, output_item.done;
- a message: output_item.added, content_part.added (output_text), output_text.delta...,
  output_text.done, content_part.done, output_item.done;
- a function call: output_item.added, function_call_arguments.delta..., function_call_arguments.done,
  output_item.done.

An item closes when the next one opens (a new kind of text, or a tool call of another index) or when
the response ends. A response whose text is empty has one message with an empty text, so that `output`
always holds the answer's message or a call.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from asyncengine.interfaces.parsers import DeltaMessage
from asyncengine.server.protocol import ChatLogprobs
from asyncengine.server.protocol_responses import (
    ContentPartAddedEvent, ContentPartDoneEvent, FunctionCallArgumentsDeltaEvent, FunctionCallArgumentsDoneEvent,
    FunctionCallItem, Logprob, OutputItem, OutputItemAddedEvent, OutputItemDoneEvent, OutputMessage, OutputText,
    OutputTextDeltaEvent, OutputTextDoneEvent, ReasoningItem, ReasoningText, ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent, ResponsesTopLogprob, StreamEvent,
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_logprobs(logprobs: ChatLogprobs | None) -> list[Logprob]:
    """Chat's token logprobs in the Responses' shape (the same fields)."""
    return [Logprob(token=entry.token, logprob=entry.logprob, bytes=entry.bytes or list(entry.token.encode()),
                    top_logprobs=[ResponsesTopLogprob(token=top.token, logprob=top.logprob,
                                             bytes=top.bytes or list(top.token.encode()))
                                  for top in entry.top_logprobs])
            for entry in (logprobs.content or [] if logprobs is not None else [])]


@dataclass
class _Open:
    """The item being written: its kind ("reasoning", "message", "function_call"), where it is in the
    output, its text so far (the arguments, for a call)."""

    kind: str
    output_index: int
    id: str
    text: str = ""
    call_index: int = -1  # the chat tool call's index, for a function call
    call_id: str = ""
    name: str = ""
    logprobs: list[Logprob] = field(default_factory=list)


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: _Open | None = None
        self._pending_logprobs: list[Logprob] = []  # of tokens whose text no delta event has carried yet
        self._closed_calls: dict[int, _Open] = {}  # chat tool-call index -> the call, once its item is done

    def add(self, delta: DeltaMessage, logprobs: list[Logprob] | None = None) -> list[StreamEvent]:
        """The events of one delta (reasoning, then content, then tool calls, as a text has them)."""
        self._pending_logprobs += logprobs or []
        events: list[StreamEvent] = []
        if delta.reasoning:
            events += self._switch("reasoning")
            events += self._reasoning_delta(delta.reasoning)
        if delta.content:
            events += self._switch("message")
            events += self._text_delta(delta.content)
        for call in delta.tool_calls or []:
            function = call.function
            arguments = function.arguments if function is not None else None
            closed = self._closed_calls.get(call.index)
            if closed is not None:  # the rest of a call a parser held back past the next one's start
                if arguments:
                    events += self._late_arguments(closed, arguments)
                continue
            if self._open is None or self._open.kind != "function_call" or self._open.call_index != call.index:
                events += self._close()
                name = function.name if function is not None and function.name else ""
                events += self._open_call(call.index, call.id or item_id("call"), name)
            if arguments:
                events += self._arguments_delta(arguments)
        return events

    def finish(self, status: str) -> list[StreamEvent]:
        """The events that close the output: the open item closed with `status` ("completed", or
        "incomplete" when the response hit max_output_tokens); an empty message when there was nothing."""
        events = [] if self.items else self._switch("message")
        events += self._close(status)
        return events

    # -- opening and closing ---------------------------------------------------------------------------

    def _switch(self, kind: str) -> list[StreamEvent]:
        if self._open is not None and self._open.kind == kind:
            return []
        events = self._close()
        prefix = "rs" if kind == "reasoning" else "msg"
        self._open = _Open(kind, len(self.items), item_id(prefix))
        item = self._item(self._open, "in_progress", partial=True)
        self.items.append(item)
        part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
        return events + [OutputItemAddedEvent(output_index=self._open.output_index, item=item),
                         ContentPartAddedEvent(item_id=self._open.id, output_index=self._open.output_index,
                                               content_index=0, part=part)]

    def _open_call(self, call_index: int, call_id: str, name: str) -> list[StreamEvent]:
        self._open = _Open("function_call", len(self.items), item_id("fc"), call_index=call_index, call_id=call_id,
                           name=name)
        item = self._item(self._open, "in_progress", partial=True)
        self.items.append(item)
        return [OutputItemAddedEvent(output_index=self._open.output_index, item=item)]

    def _close(self, status: str = "completed") -> list[StreamEvent]:
        current, self._open = self._open, None
        if current is None:
            return []
        if current.kind == "message":  # with the tokens whose text a parser held back to the end
            current.logprobs += self._pending_logprobs
            self._pending_logprobs = []
        item = self._item(current, status)
        self.items[current.output_index] = item
        item_id, output_index = current.id, current.output_index
        done = OutputItemDoneEvent(output_index=output_index, item=item)
        if current.kind == "function_call":
            self._closed_calls[current.call_index] = current
            return [FunctionCallArgumentsDoneEvent(item_id=item_id, output_index=output_index, name=current.name,
                                                   arguments=current.text), done]
        if current.kind == "reasoning":
            return [ReasoningTextDoneEvent(item_id=item_id, output_index=output_index, content_index=0,
                                           text=current.text),
                    ContentPartDoneEvent(item_id=item_id, output_index=output_index, content_index=0,
                                         part=ReasoningText(text=current.text)), done]
        return [OutputTextDoneEvent(item_id=item_id, output_index=output_index, content_index=0, text=current.text,
                                    logprobs=current.logprobs),
                ContentPartDoneEvent(item_id=item_id, output_index=output_index, content_index=0,
                                     part=OutputText(text=current.text, logprobs=current.logprobs)), done]

    @staticmethod
    def _item(current: _Open, status: str, *, partial: bool = False) -> OutputItem:
        """The item as announced (`partial`: empty) or as done."""
        text = "" if partial else current.text
        if current.kind == "reasoning":
            return ReasoningItem(id=current.id, status=status, content=[] if partial else [ReasoningText(text=text)])
        if current.kind == "message":
            return OutputMessage(id=current.id, status=status,
                                 content=[] if partial else [OutputText(text=text, logprobs=current.logprobs)])
        return FunctionCallItem(id=current.id, call_id=current.call_id, name=current.name, arguments=text,
                                status=status)

    # -- deltas ----------------------------------------------------------------------------------------

    def _reasoning_delta(self, text: str) -> list[StreamEvent]:
        current = self._current()
        current.text += text
        return [ReasoningTextDeltaEvent(item_id=current.id, output_index=current.output_index, content_index=0,
                                        delta=text)]

    def _text_delta(self, text: str) -> list[StreamEvent]:
        current = self._current()
        current.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        current.logprobs += logprobs
        return [OutputTextDeltaEvent(item_id=current.id, output_index=current.output_index, content_index=0,
                                     delta=text, logprobs=logprobs)]

    def _arguments_delta(self, text: str) -> list[StreamEvent]:
        current = self._current()
        current.text += text
        return [FunctionCallArgumentsDeltaEvent(item_id=current.id, output_index=current.output_index, delta=text)]

    def _late_arguments(self, call: _Open, text: str) -> list[StreamEvent]:
        """Arguments of a call already closed: its item is completed with them (the final response has the
        whole call) and a delta event carries them for the clients that add up deltas by item id."""
        call.text += text
        self.items[call.output_index] = self._item(call, "completed")
        return [FunctionCallArgumentsDeltaEvent(item_id=call.id, output_index=call.output_index, delta=text)]

    def _current(self) -> _Open:
        if self._open is None:  # a bug here: every delta opens its item first
            raise RuntimeError("an output delta with no open item")
        return self._open
