"""A least-recently-used cache with a budget: the compiled grammars (a budget in bytes) and the refused ones (a
budget in entries). Putting an entry evicts the least recently used ones until the rest fits; an entry larger
than the whole budget is not kept at all. The evicted values are handed back, so that the caller can free them
where their destructors may take time (off the event loop: a large compiled grammar frees in about 20 ms)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class LRUCache:
    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"an LRU cache needs a budget of at least 1, got {budget}")
        self.budget = budget
        self.size = 0  # the sum of the entries' costs, at most `budget`
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Any | None:
        """The value under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: Any, cost: int) -> tuple[bool, list[Any]]:
        """Keep `value` under `key` at `cost`: (whether it was kept, the values evicted for it)."""
        evicted = []
        previous = self._entries.pop(key, None)
        if previous is not None:
            self.size -= previous[1]
            evicted.append(previous[0])
        cost = max(0, cost)
        if cost > self.budget:
            return False, evicted
        while self.size + cost > self.budget:
            _, (old, old_cost) = self._entries.popitem(last=False)
            self.size -= old_cost
            self.num_evicted += 1
            evicted.append(old)
        self._entries[key] = (value, cost)
        self.size += cost
        return True, evicted

    def clear(self) -> list[Any]:
        values = [value for value, _ in self._entries.values()]
        self._entries.clear()
        self.size = 0
        return values
