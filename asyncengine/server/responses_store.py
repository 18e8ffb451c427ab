"""The in-memory store of Responses (`store: true`): what GET /v1/responses/{id} answers, what
`previous_response_id` continues, and the handle that POST /v1/responses/{id}/cancel aborts.

Bounded two ways (ServerConfig: --responses-store-max-entries, --responses-store-max-bytes): when either
bound is passed, the oldest finished responses are evicted until both hold again. A response still
running is never evicted (its own owner updates it when it ends; how many run at once is bounded by the
engine's admission, --max-num-seqs and --max-waiting-requests). Its size is that of its JSON, response
and conversation together, measured as it is stored. Nothing survives a restart. vLLM keeps every
stored response until the server stops (and stores only with VLLM_ENABLE_RESPONSES_API_STORE=1);
this store is on by default, as OpenAI's `store` default asks, and bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from asyncengine.server.protocol_responses import ResponsesResponse

RUNNING = frozenset({"queued", "in_progress"})


@dataclass
class StoredResponse:
    response: ResponsesResponse
    # The conversation that continues from this response: its input (without instructions) and its
    # output, as chat messages (responses_conversation.py).
    messages: list[dict[str, Any]]
    # While the response runs in the background: the scope that cancelling it cancels, and the event
    # set when its task has ended (its engine request aborted or finished).
    cancel_scope: anyio.CancelScope | None = None
    done: anyio.Event | None = None
    size: int = field(default=0)

    @property
    def running(self) -> bool:
        return self.response.status in RUNNING


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, entry: StoredResponse) -> None:
        """Store (or update) `entry` under its response's id, then evict past the bounds."""
        response_id = entry.response.id
        previous = self._entries.get(response_id)  # an update keeps the response's place: age is creation's
        if previous is not None:
            self._bytes -= previous.size
        entry.size = len(msgspec.json.encode(entry.response)) + len(msgspec.json.encode(entry.messages))
        self._entries[response_id] = entry
        self._bytes += entry.size
        self._evict()

    def _evict(self) -> None:
        if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
            return
        for response_id in [key for key, entry in self._entries.items() if not entry.running]:
            removed = self._entries.pop(response_id)
            self._bytes -= removed.size
            if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                return
