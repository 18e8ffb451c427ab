"""The engine core's side of structured outputs: compiled grammars, one matcher per request, masks.

- A constrained request's grammar is compiled when it arrives, off the event loop (compiling.py: in the
  grammar-compile process first when large, always in a thread here), once per (backend, grammar) hash:
  later requests with it share the result, kept in a cache with a byte budget. Until its matcher is ready
  the scheduler leaves the request waiting and admits others past it. A grammar whose first step allows
  no token matches nothing: the request is refused (GrammarError, a 400), never run unconstrained.
- Before a step, the masks of the constrained requests that sample in it are computed here, after
  their previous token was folded in (`bitmask`), and travel in the SchedulerOutput as int32 words.
- After a step, each matcher is advanced by its request's token (`accept`). A grammar that allows no
  next token (a dead end), or a token outside the grammar (something after the mask refused every token
  it allowed), ends the request with GrammarBroken naming its field: a constraint is never dropped.

With async scheduling and an executor that takes a step's masks after the step (`deferred_masks`,
set by the step loop; the built-in uni and mp executors), constrained requests are scheduled like the
others and their masks follow the step (deferred.py): the forward pass of step N+1 overlaps folding in
step N and computing N+1's masks. Otherwise (pipeline micro-batches, an executor or worker class that
does not take them) a constrained request is not scheduled while
any constrained request's token is in flight (Scheduler.schedule asks `sits_out`): its own next mask
depends on its own token, and holding the others back too keeps every constrained request in one
step. Scheduling the ready ones instead splits them into two halves that alternate, each step
carrying half of them, which halved a constrained W3 run's tok/s (bench/RESULTS.md).
docs/structured_outputs.md says what each costs.

With a reasoning parser configured (reasoning.py), a request is sampled without a mask until its
reasoning ends, and its grammar starts with the next token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import numpy as np

from asyncengine.config.structured_outputs import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT, reasoning_settings
from asyncengine.interfaces.parsers import ReasoningParser
from asyncengine.structured_output.backend import GrammarBroken, GrammarError, bitmask_words, load_tokenizer
from asyncengine.interfaces.structured_output import GrammarMatcher, StructuredOutputBackend
from asyncengine.structured_output.compiling import Compilations
from asyncengine.structured_output.reasoning import ReasoningGate, reasoning_parser_class
from asyncengine.structured_output.registry import backend_class
from asyncengine.config.structured_outputs import configured_backend_name
from asyncengine.structured_output_spec import GrammarSpec

logger = logging.getLogger(__name__)


NO_FIRST_TOKEN = ("it allows no token at its start, so no output can match it (a grammar whose rules never end, "
                  "such as `root ::= root`, or a regex that matches nothing, such as `[^\\s\\S]`)")


class GrammarStats:
    """What structured outputs cost so far in this engine core (seconds), for the bench and the stats."""

    def __init__(self) -> None:
        self.num_compiled = 0
        self.num_cache_hits = 0  # the cache's, and requests that shared a compile in progress
        self.num_isolated_compiles = 0  # of num_compiled, those first compiled in the grammar-compile process
        self.num_timeouts = 0
        self.num_compiles_cancelled = 0  # every request waiting for it left
        self.num_uncached = 0  # compiled grammars larger than the cache's whole budget
        self.num_dead_ends = 0  # requests ended because their grammar allowed no next token
        self.compile_seconds = 0.0  # from the start of each compile to its grammar in the cache
        self.compile_process_seconds = 0.0  # of which waiting for the grammar-compile process (its start-up too)
        self.mask_seconds = 0.0
        self.num_masks = 0
        self.backend_of: dict[str, str] = {}  # request id -> the backend that constrains it (while it runs)
        self.requests_per_backend: dict[str, int] = {}  # backend name -> requests it constrained so far

    def as_dict(self) -> dict[str, Any]:
        return {"num_compiled": self.num_compiled, "num_cache_hits": self.num_cache_hits,
                "num_isolated_compiles": self.num_isolated_compiles, "num_timeouts": self.num_timeouts,
                "num_compiles_cancelled": self.num_compiles_cancelled, "num_uncached": self.num_uncached,
                "num_dead_ends": self.num_dead_ends,
                "compile_seconds": self.compile_seconds, "compile_process_seconds": self.compile_process_seconds,
                "mask_seconds": self.mask_seconds,
                "num_masks": self.num_masks, "requests_per_backend": dict(self.requests_per_backend),
                "running_backends": dict(self.backend_of)}


@dataclass(eq=False)
class _Constrained:
    """A request with its matcher."""

    matcher: GrammarMatcher
    field: str  # the request field its grammar came from, to blame
    num_tokens: int = 0  # accepted by the grammar so far
    dead_end: bool = False  # its last mask allowed no token


class StructuredOutputManager:
    def __init__(self, *, tokenizer_dir: str | None, vocab_size: int, eos_token_ids: list[int],
                 structured_outputs_config: dict[str, Any] | None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, trust_remote_code: bool = False) -> None:
        self.default_backend = configured_backend_name(structured_outputs_config)
        self.tokenizer_dir = tokenizer_dir
        self.trust_remote_code = trust_remote_code  # --trust-remote-code: the tokenizer may ship its own code
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self.stats = GrammarStats()
        self.compilations = Compilations(cache_bytes=cache_bytes, timeout=compile_timeout, tokenizer_dir=tokenizer_dir,
                                         vocab_size=vocab_size, eos_token_ids=self.eos_token_ids, stats=self.stats,
                                         trust_remote_code=trust_remote_code)
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._pending: set[str] = set()  # requests whose matcher is not ready yet
        self._matchers: dict[str, _Constrained] = {}
        self._in_flight: set[str] = set()  # constrained requests sampling in a step not yet folded in
        self._lock = anyio.Lock()  # building a backend (tokenizer load) happens once
        # Whether a step's masks may follow the step (deferred.py): set by the step loop from its executor.
        self.deferred_masks = False
        self.reasoning: ReasoningGate | None = None
        parser_name, enable_in_reasoning = reasoning_settings(structured_outputs_config)
        if parser_name is not None and not enable_in_reasoning:
            parser_class = reasoning_parser_class(parser_name)  # an unknown name fails the engine's start
            if parser_class.is_reasoning_end is ReasoningParser.is_reasoning_end:
                # Not an error: `serve --reasoning-parser` sets the parser for every server, and a parser
                # plugin written before is_reasoning_end existed must keep serving. Its constraints then
                # cover the reasoning too, as they did before, and the log says so once, naming the parser.
                logger.warning("reasoning parser %r (%s) does not implement is_reasoning_end, so constraints cover "
                               "the reasoning too (as with enable_in_reasoning): implement it to start them after "
                               "the reasoning", parser_name, parser_class.__qualname__)
            else:
                self.reasoning = ReasoningGate(parser_class)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the compiles (and the grammar-compile process) while the step loop runs."""
        await self.compilations.serve(task_status=task_status)

    @property
    def cache_bytes(self) -> int:
        """What the compiled grammars in the cache hold (their charged sizes), at most its budget."""
        return self.compilations.cache.size

    @property
    def cache_entries(self) -> int:
        return len(self.compilations.cache)

    def stats_dict(self) -> dict[str, Any]:
        """The stats, with the cache's and the grammar-compile process's figures (get_structured_output_stats)."""
        process = self.compilations.process
        return {**self.stats.as_dict(), "cache_bytes": self.cache_bytes, "cache_entries": self.cache_entries,
                "cache_budget_bytes": self.compilations.cache.budget,
                "num_evicted": self.compilations.cache.num_evicted, "compile_process_pid": process.pid,
                "compile_process_starts": process.num_started, "compile_process_kills": process.num_killed}

    # -- compiling (a task of the step loop's task group, per request) ---------------------------------

    def track(self, request_id: str) -> None:
        """The request is constrained: it waits until `prepare` has built its matcher."""
        self._pending.add(request_id)

    async def prepare(self, request_id: str, spec: GrammarSpec, prompt_token_ids: list[int] | None = None) -> None:
        """Compile (or reuse) the grammar and build the request's matcher. GrammarError if refused."""
        name = spec.backend or self.default_backend
        try:
            backend = await self._backend(name)
            compiled = await self.compilations.compiled(request_id, backend, spec.cache_key(name), spec)
            if compiled is None or request_id not in self._pending:
                self._pending.discard(request_id)
                return  # aborted meanwhile (and its compile cancelled when nobody else waited for it)
            matcher = await anyio.to_thread.run_sync(self._first_matcher, backend, compiled, spec, name)
        except BaseException as exc:
            self._pending.discard(request_id)
            if isinstance(exc, ValueError) and not isinstance(exc, GrammarError):  # no tokenizer, say
                raise GrammarError(name, spec, str(exc)) from exc
            raise
        if request_id in self._pending:  # not aborted meanwhile
            if self.reasoning is not None:
                self.reasoning.start(request_id, self._tokenizer, list(prompt_token_ids or []))
            self._pending.discard(request_id)
            self._matchers[request_id] = _Constrained(matcher, spec.field)
            self.stats.backend_of[request_id] = name
            self.stats.requests_per_backend[name] = self.stats.requests_per_backend.get(name, 0) + 1
        else:
            self.compilations.free([matcher])

    def _first_matcher(self, backend: StructuredOutputBackend, compiled: Any, spec: GrammarSpec,
                       name: str) -> GrammarMatcher:
        """A matcher at the grammar's start (in a thread: llguidance builds its lexer here), refused when its
        first mask allows no token."""
        try:
            matcher = backend.matcher(compiled)
        except ValueError as exc:
            raise GrammarError(name, spec, str(exc).strip()) from exc
        first = np.zeros((1, self.num_words), dtype=np.int32)
        matcher.fill_bitmask(first, 0)
        if not first.any():
            raise GrammarError(name, spec, NO_FIRST_TOKEN)
        return matcher

    async def _backend(self, name: str) -> StructuredOutputBackend:
        async with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                cls = backend_class(name)
                backend = await anyio.to_thread.run_sync(self._build_backend, cls)
                self._backends[name] = backend
        return backend

    def _build_backend(self, cls: type) -> StructuredOutputBackend:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_dir, trust_remote_code=self.trust_remote_code)
        return cls(self._tokenizer, self.vocab_size, self.eos_token_ids)

    # -- the scheduler's questions ---------------------------------------------------------------------

    @property
    def num_compiling(self) -> int:
        return len(self._pending)

    @property
    def num_constrained(self) -> int:
        """Constrained requests here now (compiling or with a matcher): with none, a step asks nothing more."""
        return len(self._matchers) + len(self._pending)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._pending

    def is_ready(self, request_id: str) -> bool:
        return request_id not in self._pending

    def sits_out(self, request_id: str, num_pending_tokens: int) -> bool:
        """Whether a running request must sit out the step being scheduled: it is constrained, and its
        own token or another constrained request's is in flight (module docstring: one step, not halves).
        Never when masks follow their step (`deferred_masks`)."""
        return (not self.deferred_masks and self.is_constrained(request_id)
                and (num_pending_tokens > 0 or bool(self._in_flight)))

    def bitmask(self, request_ids: list[str]) -> tuple[list[str], bytes] | None:
        """The masks of those of `request_ids` that are constrained, as (their ids, int32 words).
        `request_ids` are the step's sampling requests: the constrained ones are in flight from here on.
        A request whose mask allows no token is at a dead end: its token is refused when it comes (`accept`)."""
        self._in_flight.update(rid for rid in request_ids if rid in self._matchers)
        constrained = [rid for rid in request_ids if rid in self._matchers
                       and not (self.reasoning is not None and self.reasoning.is_reasoning(rid))]
        if not constrained:
            return None
        started = time.perf_counter()
        words = np.full((len(constrained), self.num_words), -1, dtype=np.int32)
        for row, request_id in enumerate(constrained):
            self._matchers[request_id].matcher.fill_bitmask(words, row)
        for dead in np.flatnonzero(~words.any(axis=1)).tolist():
            self._matchers[constrained[dead]].dead_end = True
        self.stats.mask_seconds += time.perf_counter() - started
        self.stats.num_masks += len(constrained)
        return constrained, words.tobytes()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True when its grammar is now complete (it should stop).
        GrammarBroken when the grammar cannot go on: the request ends with that error."""
        self._in_flight.discard(request_id)
        constrained = self._matchers.get(request_id)
        if constrained is None:
            return False
        if self.reasoning is not None and self.reasoning.is_reasoning(request_id):
            self.reasoning.advance(request_id, token_id)  # reasoning tokens are not the grammar's
            return False
        if constrained.dead_end:
            self.stats.num_dead_ends += 1
            raise GrammarBroken(constrained.field, (
                f"the grammar allows no token after the {constrained.num_tokens} tokens generated so far: no output "
                "that starts with them matches it (a grammar that can start but never end), so the request ends"))
        if not constrained.matcher.accept_token(token_id):
            # Only a token the mask allowed reaches here, unless something after the mask refused all of those.
            raise GrammarBroken(constrained.field, (
                f"token {token_id}, sampled after {constrained.num_tokens} tokens, is outside the grammar: something "
                "applied after its mask refused every token the grammar allowed (min_tokens, which holds back the "
                "end of a complete output; logit_bias, bad_words or allowed_token_ids; a logits processor)"))
        constrained.num_tokens += 1
        return constrained.matcher.is_terminated()

    def remove(self, request_id: str) -> None:
        self._pending.discard(request_id)
        self._in_flight.discard(request_id)
        self.compilations.forget(request_id)
        constrained = self._matchers.pop(request_id, None)
        if constrained is not None:
            # Its grammar may have left the cache: its last reference, freed in a thread.
            self.compilations.free([constrained.matcher])
        self.stats.backend_of.pop(request_id, None)
        if self.reasoning is not None:
            self.reasoning.remove(request_id)
