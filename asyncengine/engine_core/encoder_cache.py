"""The encoder budget and the encoder cache, the scheduler's side (vLLM's EncoderCacheManager and names).

A multimodal item (an image) becomes `num_embeds` embedding rows when the worker runs the model's vision tower
on it. The scheduler decides when: in the first step that computes any of the item's placeholder tokens (a
chunk of the prompt may start or end inside the span; the later chunks read the cached rows). Two limits, both
counted in embedding rows:
- `max_num_encoder_input_tokens`: the encoder work of one step (vLLM's encoder compute budget);
- `encoder_cache_size`: the rows the workers hold at once.
Both default to the step's token budget (max_num_batched_tokens), as vLLM's do. An item larger than a limit
still runs when it is the step's only encoder work and the cache is otherwise empty, so no request can wait
forever; a chunk that cannot have its item now stops before the item's first token and goes on later.

The cache is keyed by the item's identifier (its content hash): requests running with the same image share
one entry, computed once. An entry lives while some request references it; a request drops its reference
once every token of the item's span is computed, and on finishing, aborting or preemption. An entry nobody
references is freed at once; the identifiers freed since the last step go to the workers in the next step's
`free_encoder_mm_hashes`, before that step's encoder work, so the workers' caches hold exactly what this one
says (checked by `num_cached_rows` returning to zero in the tests: no leak).
"""

from __future__ import annotations

from asyncengine.engine_core.sequence import Sequence
from asyncengine.interfaces.multimodal import num_embeds


class EncoderCacheManager:
    def __init__(self, cache_size: int, max_num_encoder_input_tokens: int) -> None:
        self.cache_size = cache_size
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        # This step's encoder work: request id -> indices of its items to compute, and their rows.
        self._to_compute: dict[str, list[int]] = {}
        self._rows_this_step = 0
        self._rows: dict[str, int] = {}  # identifier -> its rows, for every cached entry
        self._users: dict[str, set[str]] = {}  # identifier -> the request ids that reference it
        self._freed: list[str] = []  # identifiers freed since the last step's output

    @property
    def num_cached_rows(self) -> int:
        return sum(self._rows.values())

    @property
    def num_entries(self) -> int:
        return len(self._rows)

    def has(self, identifier: str) -> bool:
        return identifier in self._rows

    def add_user(self, identifier: str, request_id: str) -> None:
        """`request_id` references a cached entry."""
        self._users[identifier].add(request_id)

    def can_allocate(self, rows: int, rows_this_step: int) -> bool:
        """Whether an entry of `rows` fits beside the cached ones (`rows_this_step`: those already allocated
        in this step). An oversized item fits an empty cache."""
        used = self.num_cached_rows
        return used + rows <= self.cache_size or (used == 0 and rows_this_step == 0)

    def allocate(self, identifier: str, rows: int, request_id: str) -> None:
        self._rows[identifier] = rows
        self._users[identifier] = {request_id}

    def release(self, identifier: str, request_id: str) -> None:
        """`request_id` no longer needs the entry; the last user's release frees it."""
        users = self._users.get(identifier)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self._users[identifier]
            del self._rows[identifier]
            self._freed.append(identifier)

    def take_freed(self) -> list[str]:
        """The identifiers freed since the last call, for the next step's `free_encoder_mm_hashes`."""
        freed, self._freed = self._freed, []
        return freed

    # -- one step ---------------------------------------------------------------------------------------------

    def begin_step(self, running: list[Sequence]) -> None:
        """Start a step: the running sequences drop the items whose spans they have computed."""
        self._to_compute = {}
        self._rows_this_step = 0
        for seq in running:
            if seq.encoder_refs:
                for index in sorted(seq.encoder_refs):
                    position = seq.mm_features[index].position
                    if position.offset + position.length <= seq.num_computed_tokens:
                        self.release(seq.mm_features[index].identifier, seq.request_id)
                        seq.encoder_refs.discard(index)

    def plan(self, seq: Sequence, start: int, num_new: int) -> tuple[int, list[int]]:
        """How many of the `num_new` tokens from `start` `seq` can compute now (fewer when an item they reach
        does not fit this step's encoder budget or the cache: the chunk stops before the item), and the items
        among them it needs and does not hold yet. Changes nothing: `commit` does, once the blocks are had."""
        needed: list[int] = []
        rows_planned = 0
        for index, feature in enumerate(seq.mm_features):
            offset, length = feature.position.offset, feature.position.length
            if offset >= start + num_new:
                break
            if offset + length <= start or index in seq.encoder_refs:
                continue  # computed in an earlier step (or served by the prefix cache), or held already
            if not self.has(feature.identifier):
                rows = num_embeds(feature)
                rows_before = self._rows_this_step + rows_planned
                over_budget = rows_before > 0 and rows_before + rows > self.max_num_encoder_input_tokens
                if over_budget or not self.can_allocate(rows + rows_planned, rows_before):
                    return max(0, offset - start), needed
                rows_planned += rows
            needed.append(index)
        return num_new, needed

    def commit(self, seq: Sequence, needed: list[int]) -> None:
        """`seq` takes the items `plan` found it needs: a reference to a cached entry, or a new entry it computes
        in this step (also when the entry another sequence held was freed since the plan, by a preemption)."""
        for index in needed:
            feature = seq.mm_features[index]
            if self.has(feature.identifier):
                self.add_user(feature.identifier, seq.request_id)
            else:
                rows = num_embeds(feature)
                self.allocate(feature.identifier, rows, seq.request_id)
                self._rows_this_step += rows
                self._to_compute.setdefault(seq.request_id, []).append(index)
            seq.encoder_refs.add(index)

    def release_all(self, seq: Sequence) -> None:
        """`seq` finished, was aborted or preempted: it holds no item any more."""
        for index in seq.encoder_refs:
            self.release(seq.mm_features[index].identifier, seq.request_id)
        seq.encoder_refs.clear()

    def scheduled_encoder_inputs(self) -> dict[str, list[int]]:
        return self._to_compute
