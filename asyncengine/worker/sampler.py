"""Sampler: from one row of logits per request to one token per request, with vLLM's semantics.

Order of operations, per row: logprobs are taken from the raw logits (as vLLM's default
`raw_logprobs`); then the request's logit controls (allowed_token_ids, bad_words, logit_bias:
logit_controls.py); then the logits processors that may change the argmax (vLLM's order); min_tokens
masks the stop tokens; penalties (repetition on prompt and output, frequency and presence on output);
greedy rows take the argmax; for the others the batch is divided by temperature (greedy rows by 1),
the argmax-invariant logits processors run (only when some row samples at random: they cannot change
a greedy row's token), then min_p, top_k and top_p, and a draw with the exponential race (argmax of
p / E, E ~ Exp(1)).

A request with a seed draws from a generator seeded by (seed, output position), so its tokens do not
depend on which other requests share the batch, nor on whether it was preempted and recomputed.

The draw itself (the race, and the greedy argmax) is op "sample" (sample_op.py), run through the op
providers: on CUDA the triton provider, one kernel for the batch that leaves the tokens on the device.
Where the draw's noise comes from:
- on every device but CUDA, from torch generators exactly as before the op existed (the engine's
  generator for unseeded rows, one at a time for seeded rows), passed to the op as `noise`;
- on CUDA, from per-row 64-bit seeds (`_row_seeds`, computed on the host with no device work and
  copied, as the temperatures are, from pinned memory without waiting); the triton provider draws E
  from them with Philox in the kernel. A seeded row's seed is a hash of (seed, output position), as the generator's seed is
  on the CPU; an unseeded row's comes from a splitmix64 counter started from the engine's seed.
So a seeded request is reproducible on one platform, but CPU and CUDA give different tokens for the
same seed (as vLLM's do across platforms). min_p, top_k and top_p stay torch ops (a sort) on the
device, before the op; the op then gets the masked logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.models.layers.op_registry import call_op
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker.logit_controls import RequestLogitControls, apply_logit_controls
from asyncengine.worker.logits_processors import LogitsProcessors

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the 64-bit seed space
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """splitmix64's output function: nearby inputs give unrelated 64-bit outputs."""
    x = (x + _SEED_MIX) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _signed64(x: int) -> int:  # the int64 a torch tensor holds for these 64 bits
    return x - (1 << 64) if x >> 63 else x


def _filters(row: SamplingRow) -> bool:
    """Whether a random row masks tokens between the temperature and the draw."""
    options = row.options
    return options.min_p > 0.0 or options.top_k > 0 or options.top_p < 1.0


@dataclass
class SamplingRow:
    """What the sampler needs of one request this step."""

    options: SamplingOptions
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Built when the request joined the worker (RequestLogitControls.build); None without any.
    logit_controls: RequestLogitControls | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (token ids, logprobs) with the sampled token first and then the top-N; None where the
    # request did not ask for logprobs.
    logprobs: list[tuple[list[int], list[float]] | None] | None = None


@dataclass
class _Batch:
    rows: list[SamplingRow]
    device: torch.device
    greedy: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = [row.options.is_greedy for row in self.rows]

    def column(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(row.options, name) for row in self.rows], dtype=dtype, device=self.device)


def row_generator_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's generator at output position `position` (module docstring): its
    draws depend on neither the batch nor a recomputation after preemption."""
    return (seed * _SEED_MIX + position) & _MASK64


def apply_min_p_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_p, then top_k and top_p (vLLM's order), on `logits` already divided by each row's temperature
    (row i of `logits` is `rows[i]`); tokens they drop get -inf. The sampler's random draw and the
    speculative rejection sampler's target distributions both go through here."""
    batch = _Batch(rows, logits.device)
    if any(row.options.min_p > 0.0 for row in rows):
        probs = torch.softmax(logits, dim=-1)
        threshold = batch.column("min_p", torch.float32).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    use_top_k = any(row.options.top_k > 0 for row in rows)
    use_top_p = any(row.options.top_p < 1.0 for row in rows)
    if use_top_k or use_top_p:
        logits = Sampler._apply_top_k_top_p(logits, batch, use_top_k, use_top_p)
    return logits


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)
        # The unseeded rows' seeds for an in-kernel draw: a counter from the engine's seed.
        self._stream = _splitmix64(seed & _MASK64)
        self._draws = 0

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 processors: LogitsProcessors | None = None) -> SamplerOutput:
        """`processors`: the worker's logits processors, their update_state already called for this
        batch (row i of `logits` is `rows[i]`)."""
        batch = _Batch(rows, logits.device)
        logits, raw_logprobs = self.before_temperature(logits, rows, processors)
        random_rows = [i for i, greedy in enumerate(batch.greedy) if not greedy]
        argmax_invariant = processors is not None and processors.argmax_invariant
        if not random_rows or (not argmax_invariant and not any(_filters(rows[i]) for i in random_rows)):
            # Nothing between the temperature and the draw (argmax-invariant processors cannot
            # change a greedy row's token, so they run only for random rows): one op call.
            tokens = self._draw(logits, rows, random_rows)
        else:
            logits = logits.float()
            tokens = logits.argmax(dim=-1)
            # The whole batch is scaled (greedy rows by 1, their token is chosen already) so that
            # argmax-invariant processors get every row at its index, as vLLM gives them.
            temperature = torch.tensor([1.0 if greedy else row.options.temperature
                                        for greedy, row in zip(batch.greedy, rows)], device=logits.device)
            scaled = logits / temperature.unsqueeze(1)
            if argmax_invariant and processors is not None:
                scaled = processors.apply(scaled, argmax_invariant=True)
            sampled = self._sample_random(scaled[random_rows], [rows[i] for i in random_rows])
            tokens[random_rows] = sampled
        token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=self.logprobs(raw_logprobs, tokens, rows))

    def before_temperature(self, logits: torch.Tensor, rows: list[SamplingRow], processors: LogitsProcessors | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The steps before the temperature (module docstring), row i of `logits` being `rows[i]`: the logits
        they leave, and the raw logprobs (None when no row asks for logprobs). The speculative verifier
        runs them over every verified position (worker/spec_decode/verifier.py)."""
        # The logits stay in their dtype (the kernel reads half precision) until a step needs float32.
        given = logits
        raw_logprobs = (
            torch.log_softmax(logits.float(), dim=-1) if any(r.options.logprobs is not None for r in rows) else None
        )
        if any(row.logit_controls is not None for row in rows):
            logits = logits.float()
            logits = apply_logit_controls(logits.clone() if logits is given else logits,
                                          [row.logit_controls for row in rows], [row.output_token_ids for row in rows])
        if processors is not None and processors.non_argmax_invariant:
            # A processor may write in place: never into the caller's tensor.
            logits = logits.float()
            logits = processors.apply(logits.clone() if logits is given else logits, argmax_invariant=False)
        logits = self._mask_stop_tokens_before_min_tokens(logits, rows)
        if any(row.options.needs_penalties for row in rows):
            logits = self._apply_penalties(logits.float(), _Batch(rows, logits.device))
        return logits, raw_logprobs

    @property
    def generator(self) -> torch.Generator:
        """The engine's generator, which unseeded random rows draw from."""
        return self._generator

    # -- the draw (op "sample") ----------------------------------------------------------------------------

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]) -> torch.Tensor:
        """Every row of the batch in one op call: greedy rows at temperature 0, the others at theirs."""
        temperature = [0.0 if row.options.is_greedy else row.options.temperature for row in rows]
        noise = None
        if random_rows and logits.device.type != "cuda":
            noise = self._host_noise([rows[i] for i in random_rows], logits.shape[1], logits.device)
            if len(random_rows) < len(rows):
                # The op takes noise for every row; greedy rows' is never read (ones, not drawn,
                # so the generators advance exactly as before).
                full = torch.ones(logits.shape, dtype=torch.float32, device=logits.device)
                full[random_rows] = noise
                noise = full
        return call_op("sample", logits, self._to_device(temperature, torch.float32, logits.device),
                       self._to_device(self._row_seeds(rows), torch.int64, logits.device), noise)

    def _host_noise(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
        """E ~ Exp(1) for each of `rows` (all random): unseeded rows draw together from the engine's
        generator, seeded ones one by one from theirs."""
        noise = torch.empty((len(rows), vocab), dtype=torch.float32, device=device).exponential_(
            generator=self._generator)
        for index, row in enumerate(rows):
            seed = row.options.seed
            if seed is not None:
                self._row_generator.manual_seed(row_generator_seed(seed, len(row.output_token_ids)))
                noise[index].exponential_(generator=self._row_generator)
        return noise

    def _row_seeds(self, rows: list[SamplingRow]) -> list[int]:
        """The per-row seeds of an in-kernel draw (module docstring); 0 for greedy rows (unused)."""
        seeds = []
        for row in rows:
            options = row.options
            if options.is_greedy:
                seeds.append(0)
            elif options.seed is not None:
                seeds.append(_signed64(_splitmix64(row_generator_seed(options.seed, len(row.output_token_ids)))))
            else:
                self._draws += 1
                seeds.append(_signed64(_splitmix64((self._stream + self._draws * _SEED_MIX) & _MASK64)))
        return seeds

    @staticmethod
    def _to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A per-row list as a tensor on `device`: on CUDA through pinned memory, copied without
        waiting (the caching host allocator keeps the buffer until the copy has run)."""
        if device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=device)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

    # -- processing steps --------------------------------------------------------------------------------

    def _mask_stop_tokens_before_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        copied = False
        for index, row in enumerate(rows):
            options = row.options
            if len(row.output_token_ids) < options.min_tokens:
                stop_ids = [t for t in (*options.stop_token_ids, *options.eos_token_ids) if t < logits.shape[1]]
                if stop_ids:
                    if not copied:  # never write into the caller's tensor
                        logits, copied = logits.clone(), True
                    logits[index, stop_ids] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        vocab = logits.shape[1]
        output_counts = torch.zeros_like(logits)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        for index, row in enumerate(batch.rows):
            if not row.options.needs_penalties:
                continue
            if row.output_token_ids:
                out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device).clamp_(max=vocab - 1)
                output_counts[index].scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device).clamp_(max=vocab - 1)
            seen[index, prompt] = True
        seen |= output_counts > 0
        repetition = batch.column("repetition_penalty", torch.float32).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        frequency = batch.column("frequency_penalty", torch.float32).unsqueeze(1)
        presence = batch.column("presence_penalty", torch.float32).unsqueeze(1)
        return logits - frequency * output_counts - presence * (output_counts > 0).float()

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`logits` are already divided by each row's temperature."""
        logits = apply_min_p_top_k_top_p(logits, rows)
        noise = None if logits.device.type == "cuda" else self._host_noise(rows, logits.shape[1], logits.device)
        ones = torch.ones(len(rows), dtype=torch.float32, device=logits.device)  # already divided by T
        seeds = self._to_device(self._row_seeds(rows), torch.int64, logits.device)
        return call_op("sample", logits, ones, seeds, noise)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, batch: _Batch, use_top_k: bool, use_top_p: bool) -> torch.Tensor:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        if use_top_k:
            top_k = batch.column("top_k", torch.long)
            top_k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            drop |= ranks >= top_k.unsqueeze(1)
        if use_top_p:
            top_p = batch.column("top_p", torch.float32).unsqueeze(1)
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # Mass strictly before each token: a token is kept while that is below top_p, so the
            # most likely token always stays. A top_p below float32's smallest normal (1.2e-38) rounds
            # to 0 or a subnormal here: kept explicitly, the most likely token stays for it too, which is
            # what any top_p at or below that token's probability (at least 1 / vocabulary) keeps
            # (docs/sampling.md, "Limits").
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= top_p
            drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def logprobs(
        raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, rows: list[SamplingRow]
    ) -> list[tuple[list[int], list[float]] | None] | None:
        if raw_logprobs is None:
            return None
        max_n = max(row.options.logprobs or 0 for row in rows)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_n > 0:
            top = raw_logprobs.topk(max_n, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        result: list[tuple[list[int], list[float]] | None] = []
        token_list = tokens.tolist()
        for index, row in enumerate(rows):
            n = row.options.logprobs
            if n is None:
                result.append(None)
                continue
            ids = [token_list[index]] + (top_ids[index][:n] if n else [])
            values = [chosen[index]] + (top_values[index][:n] if n else [])
            result.append((ids, values))
        return result
