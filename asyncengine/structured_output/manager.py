"""The engine core's side of structured outputs: compiled grammars, one matcher per request, masks.

- A constrained request's grammar is compiled when it arrives, in a worker thread (the step loop and
  the event loop go on), once per (backend, grammar) hash: later requests with it share the result.
  Until it is ready the scheduler leaves the request waiting and admits others past it.
- Before a step, the masks of the constrained requests that sample in it are computed here, after
  their previous token was folded in (`bitmask`), and travel in the SchedulerOutput as int32 words.
- After a step, each matcher is advanced by its request's token (`accept`).

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
from typing import Any

import anyio
import numpy as np

from asyncengine.config.structured_outputs import reasoning_settings
from asyncengine.interfaces.parsers import ReasoningParser
from asyncengine.structured_output.backend import GrammarError, GrammarMatcher, StructuredOutputBackend, bitmask_words
from asyncengine.structured_output.reasoning import ReasoningGate, reasoning_parser_class
from asyncengine.structured_output.registry import backend_class, configured_backend_name
from asyncengine.structured_output_spec import GrammarSpec

logger = logging.getLogger(__name__)


class GrammarStats:
    """What structured outputs cost so far in this engine core (seconds), for the bench and the stats."""

    def __init__(self) -> None:
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        self.mask_seconds = 0.0
        self.num_masks = 0
        self.backend_of: dict[str, str] = {}  # request id -> the backend that constrains it (while it runs)
        self.requests_per_backend: dict[str, int] = {}  # backend name -> requests it constrained so far

    def as_dict(self) -> dict[str, Any]:
        return {"num_compiled": self.num_compiled, "num_cache_hits": self.num_cache_hits,
                "compile_seconds": self.compile_seconds, "mask_seconds": self.mask_seconds,
                "num_masks": self.num_masks, "requests_per_backend": dict(self.requests_per_backend),
                "running_backends": dict(self.backend_of)}


class StructuredOutputManager:
    def __init__(self, *, tokenizer_dir: str | None, vocab_size: int, eos_token_ids: list[int],
                 structured_outputs_config: dict[str, Any] | None, trust_remote_code: bool = False) -> None:
        self.default_backend = configured_backend_name(structured_outputs_config)
        self.tokenizer_dir = tokenizer_dir
        self.trust_remote_code = trust_remote_code  # --trust-remote-code: the tokenizer may ship its own code
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self.stats = GrammarStats()
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._compiled: dict[str, Any] = {}
        self._compiling: dict[str, anyio.Event] = {}
        self._failures: dict[str, GrammarError] = {}
        self._pending: set[str] = set()  # requests whose grammar is not ready yet
        self._matchers: dict[str, GrammarMatcher] = {}
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

    # -- compiling (a task of the step loop's task group, per request) ---------------------------------

    def track(self, request_id: str) -> None:
        """The request is constrained: it waits until `prepare` has built its matcher."""
        self._pending.add(request_id)

    async def prepare(self, request_id: str, spec: GrammarSpec, prompt_token_ids: list[int] | None = None) -> None:
        """Compile (or reuse) the grammar and build the request's matcher. GrammarError if refused."""
        name = spec.backend or self.default_backend
        try:
            backend = await self._backend(name)
            key = spec.cache_key(name)
            compiled = await self._compiled_grammar(backend, key, spec)
            matcher = backend.matcher(compiled)
        except ValueError as exc:
            self._pending.discard(request_id)
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(name, spec, str(exc)) from exc
        if request_id in self._pending:  # not aborted meanwhile
            if self.reasoning is not None:
                self.reasoning.start(request_id, self._tokenizer, list(prompt_token_ids or []))
            self._pending.discard(request_id)
            self._matchers[request_id] = matcher
            self.stats.backend_of[request_id] = name
            self.stats.requests_per_backend[name] = self.stats.requests_per_backend.get(name, 0) + 1

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
            if self.tokenizer_dir is None:
                raise ValueError("structured outputs need the model's tokenizer, and the engine runs with "
                                 "skip_tokenizer_init")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True,
                                                            trust_remote_code=self.trust_remote_code)
        return cls(self._tokenizer, self.vocab_size, self.eos_token_ids)

    async def _compiled_grammar(self, backend: StructuredOutputBackend, key: str, spec: GrammarSpec) -> Any:
        while True:
            if key in self._compiled:
                self.stats.num_cache_hits += 1
                return self._compiled[key]
            if key in self._failures:
                raise self._failures[key]
            busy = self._compiling.get(key)
            if busy is None:
                break
            await busy.wait()  # another request compiles the same grammar: share its result
        done = self._compiling[key] = anyio.Event()
        started = time.perf_counter()
        try:
            compiled = await anyio.to_thread.run_sync(backend.compile, spec)
        except ValueError as exc:
            self._failures[key] = GrammarError(backend.name or type(backend).__name__, spec, str(exc))
            raise self._failures[key] from exc
        finally:
            del self._compiling[key]
            done.set()
        self.stats.compile_seconds += time.perf_counter() - started
        self.stats.num_compiled += 1
        self._compiled[key] = compiled
        return compiled

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
        `request_ids` are the step's sampling requests: the constrained ones are in flight from here on."""
        self._in_flight.update(rid for rid in request_ids if rid in self._matchers)
        constrained = [rid for rid in request_ids if rid in self._matchers
                       and not (self.reasoning is not None and self.reasoning.is_reasoning(rid))]
        if not constrained:
            return None
        started = time.perf_counter()
        words = np.full((len(constrained), self.num_words), -1, dtype=np.int32)
        for row, request_id in enumerate(constrained):
            self._matchers[request_id].fill_bitmask(words, row)
        self.stats.mask_seconds += time.perf_counter() - started
        self.stats.num_masks += len(constrained)
        return constrained, words.tobytes()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True when its grammar is now complete (it should stop)."""
        self._in_flight.discard(request_id)
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if self.reasoning is not None and self.reasoning.is_reasoning(request_id):
            self.reasoning.advance(request_id, token_id)  # reasoning tokens are not the grammar's
            return False
        if not matcher.accept_token(token_id):
            # Only a token the mask allowed reaches here, unless a later logits step undid the mask
            # (then the output may leave the grammar): say so once per request, and stop constraining.
            logger.warning("request %s: token %d is outside its grammar; it is no longer constrained",
                           request_id, token_id)
            del self._matchers[request_id]
            return False
        return matcher.is_terminated()

    def remove(self, request_id: str) -> None:
        self._pending.discard(request_id)
        self._in_flight.discard(request_id)
        self._matchers.pop(request_id, None)
        self.stats.backend_of.pop(request_id, None)
        if self.reasoning is not None:
            self.reasoning.remove(request_id)
