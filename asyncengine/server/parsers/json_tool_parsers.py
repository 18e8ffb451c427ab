"""Tool parsers for the formats whose calls carry their arguments as JSON (vLLM's names):

- `llama3_json` (Llama 3.1-3.3): `{"name": "f", "parameters": {...}}`, several joined by `;`, opening
  the output or after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11), or
  `[TOOL_CALLS]f{...}[TOOL_CALLS]g{...}` (v11 on; `[TOOL_CALLS]f[ARGS]{...}` from v13).
- `granite` (Granite 3.0/3.1): `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]` (3.1 writes
  `<tool_call>`; the list alone at the start of the output also counts).
- `internlm` (InternLM2.5): `<|action_start|><|plugin|>{"name": "f", "parameters": {...}}<|action_end|>`.
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; `deepseek_v31`: the same without the type and fence,
  `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.

Text before the first call, and after the calls, is content. The arguments are the JSON object as the
model wrote it (checked with json.loads), streamed as it is written; "arguments" and "parameters" are
both read, since chat templates teach either.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

from asyncengine.server.parsers.incremental import (
    IncrementalToolParser,
    ScannedCall,
    ToolScan,
    add_leading_content,
    add_trailing_content,
    content_up_to,
    read_list,
    read_marked_blocks,
)
from asyncengine.server.parsers.text_scan import (
    MalformedText,
    find_growing,
    is_prefix_of_any,
    json_value_end,
    object_has_begun,
    parse_json_object_text,
    scan_json_call,
    skip_space,
)


def read_call_object(text: str, start: int, scan: ToolScan, *, require_arguments: bool) -> int | None:
    """Read the `{"name": ..., "arguments": ...}` object at `start` into `scan`; where it ends, or None
    while the text has not ended it. `require_arguments`: an object without arguments is not a call
    (for formats with no marker, where a JSON answer with a "name" key would otherwise be one)."""
    scan.reading_from = start
    call = scan_json_call(text, start, scan.memo)
    # A stream starts a call once its arguments object has begun (or the call is complete): a name
    # alone, or arguments that are not an object, may still turn out not to be a call.
    begun = call.end is not None or (call.arguments_start is not None
                                     and object_has_begun(text, call.arguments_start))
    scanned = ScannedCall(name=call.name if begun else None)
    if call.arguments_start is not None:
        if call.arguments_end is not None:
            scanned.arguments = parse_json_object_text(text[call.arguments_start:call.arguments_end])
        elif text.startswith("{", call.arguments_start):
            scanned.arguments = text[call.arguments_start:]  # an object being written: stream it as it comes
    if call.end is not None:
        if call.name is None:
            raise MalformedText("a call object without a name")
        if call.arguments_start is None:
            if require_arguments:
                raise MalformedText("a call object without arguments")
            scanned.arguments = "{}"
        scanned.complete = True
    scan.calls.append(scanned)
    return call.end


def read_arguments_object(text: str, position: int, name: str, scan: ToolScan,
                          final: bool) -> tuple[ScannedCall, int] | None:
    """The arguments object at `position` of a call named `name` (formats that write the name outside
    the JSON): the call, added to `scan` once its object has begun, and where the object ends; None
    while it has not. The caller marks the call complete once its format's closing is read."""
    if position >= len(text):
        scan.ended_early(final)
        return None
    if text[position] != "{":
        raise MalformedText("a call's arguments must be a JSON object")
    call = ScannedCall(name=name)
    end = json_value_end(text, position, scan.memo)
    if end is None:
        if object_has_begun(text, position):
            call.arguments = text[position:]
            scan.calls.append(call)
        scan.ended_early(final)
        return None
    call.arguments = parse_json_object_text(text[position:end])
    scan.calls.append(call)
    return call, end


def read_call_list(text: str, start: int, scan: ToolScan, final: bool) -> int | None:
    """Read the JSON list of call objects at `start` (a "["); where it ends, or None."""
    return read_list(text, start + 1, scan, final,
                     lambda position: read_call_object(text, position, scan, require_arguments=False))


# -- llama3_json ----------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(IncrementalToolParser):
    """Llama 3.x's JSON calls: `{"name": "f", "parameters": {...}}` objects separated by `;` (or
    white space), opening the output, or after `<|python_tag|>` (text before it is content). Each
    object needs its "parameters" (or "arguments"): a JSON answer is not a call. Output that starts
    with anything else is content (vLLM's non-streamed parser also looks for calls after text; its
    streamed one does not: here both read the same)."""

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        tag = find_growing(text, PYTHON_TAG, 0, scan.memo)
        if tag != -1:
            scan.add_content(0, tag)
            position = tag + len(PYTHON_TAG)
        else:
            position = skip_space(text, 0)
            if position == len(text) and not final:
                return  # only white space so far: a call may still open
            if position == len(text) or text[position] != "{":
                add_leading_content(text, scan, final, (PYTHON_TAG,))
                return
        scan.reading_from = position
        while True:
            position = skip_space(text, position)
            if position >= len(text):
                if not scan.calls:
                    scan.ended_early(final)  # a tag and nothing after it
                return
            if text[position] != "{":
                if not scan.calls:
                    raise MalformedText("no call object after <|python_tag|>")
                add_trailing_content(text, position, scan, final)
                return
            end = read_call_object(text, position, scan, require_arguments=True)
            if end is None:
                scan.ended_early(final)
                return
            position = skip_space(text, end)
            if text.startswith(";", position):
                position += 1


# -- mistral --------------------------------------------------------------------------------------------

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"[\w.\-]*")
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser(IncrementalToolParser):
    """Mistral's `[TOOL_CALLS]`: a JSON list of call objects after it (tokenizers before v11), or one
    `name{arguments}` per marker (v11; v13 writes `name[ARGS]{arguments}`, with an optional
    `[CALL_ID]id` before `[ARGS]`). Text before the first marker, and after the calls, is content.
    Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when the client
    sends the calls back."""

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        found = content_up_to(text, scan, (TOOL_CALLS,))
        if found is None:
            add_leading_content(text, scan, final, (TOOL_CALLS,))
            return
        position = found[0]
        while True:
            scan.reading_from = position
            start = skip_space(text, position + len(TOOL_CALLS))
            if start >= len(text):
                scan.ended_early(final)
                return
            end = (read_call_list(text, start, scan, final) if text[start] == "["
                   else self._read_named_call(text, start, scan, final))
            if end is None:
                return
            position = skip_space(text, end)
            if not text.startswith(TOOL_CALLS, position):
                add_trailing_content(text, position, scan, final, (TOOL_CALLS,))
                return

    @staticmethod
    def _read_named_call(text: str, start: int, scan: ToolScan, final: bool) -> int | None:
        name_end = _MISTRAL_NAME.match(text, start).end()  # type: ignore[union-attr]  # matches "" at worst
        position = name_end
        if position < len(text) and text[position] == "[":
            rest = text[position:]
            if is_prefix_of_any(rest, (ARGS, CALL_ID)):
                scan.ended_early(final)
                return None
            if rest.startswith(CALL_ID):
                args = text.find(ARGS, position)
                if args == -1:
                    scan.ended_early(final)
                    return None
                position = args
            if not text.startswith(ARGS, position):
                raise MalformedText("expected [ARGS] after a call's name")
            position += len(ARGS)
        if name_end == start:
            raise MalformedText("a call is a name followed by its arguments' JSON object")
        read = read_arguments_object(text, position, text[start:name_end], scan, final)
        if read is None:
            return None
        call, end = read
        call.complete = True
        return end


# -- granite --------------------------------------------------------------------------------------------

GRANITE_MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(IncrementalToolParser):
    """Granite 3.0's `<|tool_call|>` (3.1: `<tool_call>`) followed by a JSON list of call objects, which
    may give the arguments before the name; text before the marker is content. The list alone, opening
    the output, counts too (vLLM's form)."""

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        found = content_up_to(text, scan, GRANITE_MARKERS)
        if found is not None:
            position = skip_space(text, found[0] + len(found[1]))
        else:
            position = skip_space(text, 0)
            if position == len(text) and not final:
                return
            if position == len(text) or text[position] != "[":
                add_leading_content(text, scan, final, GRANITE_MARKERS)
                return
            scan.reading_from = position
        if position >= len(text):
            scan.ended_early(final)
            return
        if text[position] != "[":
            raise MalformedText("expected a JSON list of calls after the marker")
        end = read_call_list(text, position, scan, final)
        if end is not None:
            add_trailing_content(text, end, scan, final)


# -- internlm -------------------------------------------------------------------------------------------

ACTION_START = "<|action_start|><|plugin|>"
ACTION_END = "<|action_end|>"


class InternLMToolParser(IncrementalToolParser):
    """InternLM2/2.5's `<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>`; the
    closing marker may be missing at the end of the output (it is a stop token in some configs). Text
    around the blocks is content."""

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        def read_block(start: int) -> int | None:
            if start >= len(text):
                return None
            return read_call_object(text, start, scan, require_arguments=False)

        read_marked_blocks(text, scan, final, ACTION_START, ACTION_END, read_block)


# -- deepseek_v3, deepseek_v31 --------------------------------------------------------------------------

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
JSON_FENCE = "```json"
FENCE = "```"


class DeepSeekV3ToolParser(IncrementalToolParser):
    """DeepSeek-V3's calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence, then
    `<｜tool▁call▁end｜>`. Text before the calls is content (and after them, if any)."""

    fenced = True  # deepseek_v31 writes NAME<｜tool▁sep｜>{...} without a type or fence

    def read(self, text: str, request: Any, final: bool, scan: ToolScan) -> None:
        found = content_up_to(text, scan, (CALLS_BEGIN,))
        if found is None:
            add_leading_content(text, scan, final, (CALLS_BEGIN,))
            return
        position = found[0] + len(CALLS_BEGIN)
        while True:
            position = skip_space(text, position)
            rest = text[position:position + len(CALL_BEGIN)]
            if text.startswith(CALLS_END, position):
                add_trailing_content(text, position + len(CALLS_END), scan, final)
                return
            if position >= len(text) or (not text.startswith(CALL_BEGIN, position)
                                         and is_prefix_of_any(rest, (CALL_BEGIN, CALLS_END))):
                if final and scan.calls:
                    return  # the closing marker never came (a stop token, or the length limit)
                scan.ended_early(final)
                return
            if not text.startswith(CALL_BEGIN, position):
                raise MalformedText("expected <｜tool▁call▁begin｜>")
            scan.reading_from = position
            end = self._read_call(text, position + len(CALL_BEGIN), scan, final)
            if end is None:
                return
            position = end

    def _read_call(self, text: str, start: int, scan: ToolScan, final: bool) -> int | None:
        separator = text.find(TOOL_SEP, start)
        if separator == -1:
            scan.ended_early(final)
            return None
        if self.fenced:
            if text[start:separator].strip() != "function":
                raise MalformedText("a DeepSeek-V3 call's type must be 'function'")
            name_end = text.find("\n", separator)
            if name_end == -1:
                scan.ended_early(final)
                return None
            name = text[separator + len(TOOL_SEP):name_end].strip()
            position = skip_space(text, name_end)
            if not text.startswith(JSON_FENCE, position):
                if is_prefix_of_any(text[position:], (JSON_FENCE,)):
                    scan.ended_early(final)
                    return None
                raise MalformedText("expected a ```json fence before the arguments")
            position = skip_space(text, position + len(JSON_FENCE))
        else:
            name = text[start:separator].strip()
            position = skip_space(text, separator + len(TOOL_SEP))
        if not name or "<｜" in name or "\n" in name:
            raise MalformedText(f"{name!r} is not a function name")
        read = read_arguments_object(text, position, name, scan, final)
        if read is None:
            return None
        call, end = read
        position = skip_space(text, end)
        if self.fenced:
            if not text.startswith(FENCE, position):
                return self._wait_for(text, position, FENCE, final, scan)
            position = skip_space(text, position + len(FENCE))
        if not text.startswith(CALL_END, position):
            return self._wait_for(text, position, CALL_END, final, scan)
        call.complete = True
        return position + len(CALL_END)

    @staticmethod
    def _wait_for(text: str, position: int, marker: str, final: bool, scan: ToolScan) -> int | None:
        if position < len(text) and not marker.startswith(text[position:]):
            raise MalformedText(f"expected {marker!r} after a call's arguments")
        scan.ended_early(final)
        return None


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1's calls: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` inside
    `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`."""

    fenced = False
