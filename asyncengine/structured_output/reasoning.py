"""With a reasoning parser: a constrained request's grammar starts once its reasoning has ended
(vLLM's behaviour; `structured_outputs_config`'s `reasoning_parser`, which serve sets from
--reasoning-parser, and `enable_in_reasoning` to constrain the reasoning too).

The parser is read here, in the engine core, where the masks are computed. Each constrained request
gets a parser instance of its own (parsers may keep state, as the route's do). It is asked first
about the end of the prompt (a chat template may have closed the reasoning already, as with thinking
turned off), then after each sampled token about the latest WINDOW tokens; until it says the
reasoning ended, the request is sampled without a mask and its tokens do not reach its matcher.
"""

from __future__ import annotations

from typing import Any

from asyncengine.interfaces.parsers import ReasoningParser, ReasoningParserManager
from asyncengine.interfaces.registry import reads

WINDOW = 64  # tokens: an end-of-reasoning marker is far shorter


@reads("reasoning_parsers", "engine core")
def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class of the reasoning parser a constraint waits for; ConfigError naming the known ones."""
    return ReasoningParserManager.get_reasoning_parser(name)


class ReasoningGate:
    """Which constrained requests are still reasoning, and when each stops."""

    def __init__(self, parser_class: type[ReasoningParser]) -> None:
        self.parser_class = parser_class
        self._reasoning: dict[str, tuple[ReasoningParser, list[int]]] = {}  # request id -> (parser, latest tokens)

    def start(self, request_id: str, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        parser = self.parser_class(tokenizer)
        if not parser.is_reasoning_end(prompt_token_ids[-WINDOW:]):
            self._reasoning[request_id] = (parser, [])

    def is_reasoning(self, request_id: str) -> bool:
        return request_id in self._reasoning

    def advance(self, request_id: str, token_id: int) -> None:
        """After a sampled token of a request that is still reasoning: did its reasoning end with it?"""
        parser, latest = self._reasoning[request_id]
        latest.append(token_id)
        del latest[:-WINDOW]
        if parser.is_reasoning_end(latest):
            del self._reasoning[request_id]  # the next token is the grammar's first

    def remove(self, request_id: str) -> None:
        self._reasoning.pop(request_id, None)
