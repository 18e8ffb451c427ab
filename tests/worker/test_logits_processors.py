"""Batch-level logits processors in the worker: the row layout and the BatchUpdates it produces, the
processor set (errors named by class), and where the sampler applies processors.

The layout is checked against a model processor that applies every BatchUpdate the way vLLM's
built-in processors do (added, removed, then moved in order): after each step its rows must hold
exactly the layout's requests, whatever joins and leaves.
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine.errors import StartupError
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.interfaces.logits import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, MovedRequest
from asyncengine.worker.logits_processors import (
    LogitsProcessorError,
    LogitsProcessors,
    PersistentBatch,
    merge_processor_classes,
)
from asyncengine.worker.sampler import Sampler, SamplingRow

# The sampler's draw is op "sample", run through the op providers: the platform must be resolved.
pytestmark = pytest.mark.usefixtures("cpu_platform")

CPU = torch.device("cpu")
UNI = MoveDirectionality.UNIDIRECTIONAL


def describe(key):
    return f"params of {key}", [0], [f"output of {key}"]


def step(batch: PersistentBatch, keys) -> BatchUpdate | None:
    return batch.step(list(keys), describe)


def added(index, key) -> AddedRequest:
    return AddedRequest(index, *describe(key))


# --- the layout -----------------------------------------------------------------------------------


def test_the_first_step_adds_every_request_in_order():
    batch = PersistentBatch()
    assert step(batch, "ABC") == BatchUpdate(3, removed=[], added=[added(0, "A"), added(1, "B"), added(2, "C")],
                                             moved=[])
    assert batch.rows == ["A", "B", "C"]


def test_the_same_requests_in_any_order_are_no_change():
    batch = PersistentBatch()
    step(batch, "ABC")
    assert step(batch, "CAB") is None
    assert batch.rows == ["A", "B", "C"]  # rows stay put: the layout, not the scheduler, orders them


def test_a_request_leaving_the_middle_is_replaced_by_the_last_row():
    batch = PersistentBatch()
    step(batch, "ABCD")
    assert step(batch, "ACD") == BatchUpdate(3, removed=[1], added=[], moved=[MovedRequest(3, 1, UNI)])
    assert batch.rows == ["A", "D", "C"]


def test_an_arriving_request_takes_a_freed_row_and_is_only_added():
    batch = PersistentBatch()
    step(batch, "ABC")
    assert step(batch, "ACE") == BatchUpdate(3, removed=[], added=[added(1, "E")], moved=[])
    assert batch.rows == ["A", "E", "C"]


def test_more_arrivals_than_free_rows_append():
    batch = PersistentBatch()
    step(batch, "AB")
    assert step(batch, "BXYZ") == BatchUpdate(4, removed=[], added=[added(0, "X"), added(2, "Y"), added(3, "Z")],
                                              moved=[])
    assert batch.rows == ["X", "B", "Y", "Z"]


def test_leaving_from_the_end_needs_no_move():
    batch = PersistentBatch()
    step(batch, "ABC")
    assert step(batch, "AB") == BatchUpdate(2, removed=[2], added=[], moved=[])


def test_several_leave_at_once():
    batch = PersistentBatch()
    step(batch, "ABCDE")
    assert step(batch, "AC") == BatchUpdate(2, removed=[1, 3, 4], added=[], moved=[MovedRequest(2, 1, UNI)])
    assert batch.rows == ["A", "C"]


def test_a_request_twice_in_one_step_is_refused():
    with pytest.raises(ValueError, match="twice"):
        step(PersistentBatch(), "AA")


class ModelProcessor:
    """Row -> request, maintained from BatchUpdates only, as a vLLM processor does."""

    def __init__(self) -> None:
        self.rows: dict[int, str] = {}

    def update(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        assert not {a.index for a in update.added} & set(update.removed)
        for index, params, _prompt, _output in update.added:
            self.rows[index] = params.removeprefix("params of ")
        for index in update.removed:
            del self.rows[index]
        for source, target, direction in update.moved:
            assert direction is UNI and target not in self.rows
            self.rows[target] = self.rows.pop(source)


def test_a_processor_following_the_updates_always_knows_every_row():
    rng = random.Random(1234)
    batch, model = PersistentBatch(), ModelProcessor()
    running: list[str] = []
    for number in range(3000):
        # Requests join, leave, and sit out steps (a chunked prefill, a step they are not scheduled in).
        running = [key for key in running if rng.random() > 0.15]
        running += [f"r{number}.{i}" for i in range(rng.choice([0, 0, 1, 2, 5]))]
        keys = [key for key in running if rng.random() > 0.1]
        rng.shuffle(keys)
        if not keys:
            continue
        update = step(batch, keys)
        model.update(update)
        assert model.rows == dict(enumerate(batch.rows))
        assert sorted(batch.rows) == sorted(keys)
        if update is not None:
            assert update.batch_size == len(keys)


# --- the processor set ----------------------------------------------------------------------------


class Scale(LogitsProcessor):
    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits * 2


class Invariant(Scale):
    def is_argmax_invariant(self):
        return True


class ReturnsNothing(Scale):
    def apply(self, logits):
        logits.mul_(2)  # in place, but forgets to return


class BadState(Scale):
    def update_state(self, batch_update):
        raise KeyError(7)


class BadInit(Scale):
    def __init__(self, *args):
        raise RuntimeError("no device for me")


def build(*classes) -> LogitsProcessors | None:
    return LogitsProcessors.build(classes, None, CPU, False)


def test_no_classes_build_nothing():
    assert build() is None


def test_processors_are_sorted_by_argmax_invariance():
    processors = build(Scale, Invariant)
    assert [type(p) for p in processors.non_argmax_invariant] == [Scale]
    assert [type(p) for p in processors.argmax_invariant] == [Invariant]


def test_a_constructor_that_raises_fails_start_up_naming_the_class():
    with pytest.raises(StartupError, match="test_logits_processors:BadInit could not be built: RuntimeError"):
        build(BadInit)


def test_apply_must_return_logits():
    with pytest.raises(LogitsProcessorError, match=r"ReturnsNothing: apply\(\) returned NoneType"):
        build(ReturnsNothing).apply(torch.zeros(2, 3), argmax_invariant=False)


def test_update_state_errors_name_the_processor():
    with pytest.raises(LogitsProcessorError, match=r"BadState raised in update_state\(\): KeyError: 7"):
        build(BadState).update_state(None)


def test_the_same_class_from_both_doors_is_used_once():
    assert merge_processor_classes([Scale, Invariant], [Invariant, Scale, BadState]) == [Scale, Invariant, BadState]


# --- in the sampler -------------------------------------------------------------------------------


class BanFirstToken(LogitsProcessor):
    """Bans token 0 in every row; counts calls."""

    def __init__(self, *args):
        super().__init__(*args)
        self.applied = 0

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        self.applied += 1
        logits[:, 0] = float("-inf")
        return logits


class SeesLogits(Invariant):
    def __init__(self, *args):
        super().__init__(*args)
        self.seen: list[torch.Tensor] = []

    def apply(self, logits):
        self.seen.append(logits.clone())
        return logits


def rows(*temperatures, logprobs=None):
    return [SamplingRow(SamplingOptions(temperature=t, logprobs=logprobs), [1], []) for t in temperatures]


LOGITS = torch.tensor([[4.0, 1.0, 0.0, -1.0], [3.0, 2.0, 0.0, -2.0]])


def test_a_processor_changes_greedy_tokens_and_never_the_callers_tensor():
    processors = build(BanFirstToken)
    given = LOGITS.clone()
    out = Sampler(4, CPU, 0)(given, rows(0.0, 0.0), processors)
    assert out.token_ids == [1, 1]
    assert torch.equal(given, LOGITS)


def test_logprobs_stay_raw_as_in_vllm():
    out = Sampler(4, CPU, 0)(LOGITS.clone(), rows(0.0, 0.0, logprobs=1), build(BanFirstToken))
    raw = torch.log_softmax(LOGITS, dim=-1)
    ids, values = out.logprobs[0]
    assert ids == [1, 0] and values == pytest.approx([raw[0, 1].item(), raw[0, 0].item()])


def test_argmax_invariant_processors_are_skipped_when_every_row_is_greedy():
    processors = build(SeesLogits)
    Sampler(4, CPU, 0)(LOGITS.clone(), rows(0.0, 0.0), processors)
    assert processors.argmax_invariant[0].seen == []


def test_argmax_invariant_processors_see_the_whole_batch_after_temperature():
    processors = build(SeesLogits)
    Sampler(4, CPU, 0)(LOGITS.clone(), rows(0.0, 0.5), processors)
    (seen,) = processors.argmax_invariant[0].seen
    assert torch.allclose(seen, torch.stack([LOGITS[0], LOGITS[1] / 0.5]))
