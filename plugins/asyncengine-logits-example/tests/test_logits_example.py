"""BannedTokensProcessor on plain torch tensors: validation, the row bookkeeping, apply, the record."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import ae_logits_example
from ae_logits_example import BannedTokensProcessor
from asyncengine import SamplingParams
from asyncengine.plugins_api import AddedRequest, BatchUpdate, MovedRequest, MoveDirectionality, RequestError

INF = float("-inf")


def options(banned=None):
    """What a worker hands over as a request's params: only extra_args matters here."""
    return SimpleNamespace(extra_args=None if banned is None else {"banned_token_ids": banned})


def added(index, banned=None):
    return AddedRequest(index, options(banned), [1, 2], [])


def update(batch_size, *, added=(), removed=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved))


def make():
    return BannedTokensProcessor(None, torch.device("cpu"), False)


def banned_rows(processor, batch_size, vocab=6):
    logits = processor.apply(torch.zeros(batch_size, vocab))
    return [[column for column in range(vocab) if logits[row, column] == INF] for row in range(batch_size)]


# --- validate_params ------------------------------------------------------------------------------


@pytest.mark.parametrize("extra_args", [None, {}, {"other": 1}, {"banned_token_ids": []},
                                        {"banned_token_ids": [0, 5, 996]}])
def test_valid_arguments_pass(extra_args):
    BannedTokensProcessor.validate_params(SamplingParams(extra_args=extra_args))


@pytest.mark.parametrize("ids", [3, "3", [1.5], [True], [-1], [[1]], {"a": 1}])
def test_bad_ids_are_a_request_error_naming_the_field(ids):
    with pytest.raises(RequestError) as info:
        BannedTokensProcessor.validate_params(SamplingParams(extra_args={"banned_token_ids": ids}))
    assert info.value.field == "extra_args.banned_token_ids"


# --- update_state and apply -----------------------------------------------------------------------


def test_only_rows_whose_request_bans_tokens_are_masked():
    processor = make()
    processor.update_state(update(3, added=[added(0, [1, 4]), added(1), added(2, [0])]))
    assert banned_rows(processor, 3) == [[1, 4], [], [0]]


def test_apply_keeps_the_other_logits_and_returns_the_tensor():
    processor = make()
    processor.update_state(update(2, added=[added(0, [2]), added(1)]))
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    expected = logits.clone()
    expected[0, 2] = INF
    assert torch.equal(processor.apply(logits), expected)


def test_ids_beyond_the_vocabulary_are_ignored():
    processor = make()
    processor.update_state(update(1, added=[added(0, [3, 999])]))
    assert banned_rows(processor, 1) == [[3]]


def test_none_means_nothing_changed():
    processor = make()
    processor.update_state(update(2, added=[added(0, [1]), added(1, [2])]))
    processor.update_state(None)
    assert banned_rows(processor, 2) == [[1], [2]]


def test_removed_rows_forget_their_tokens_and_a_new_request_in_a_freed_row_gets_its_own():
    processor = make()
    processor.update_state(update(2, added=[added(0, [1]), added(1, [2])]))
    processor.update_state(update(2, removed=[1], added=[added(0)]))  # row 0 re-used by a request without bans
    assert banned_rows(processor, 2) == [[], []]


def test_unidirectional_moves_carry_the_tokens():
    processor = make()
    processor.update_state(update(3, added=[added(0, [1]), added(1, [2]), added(2, [3])]))
    # Row 0 leaves; the last row moves into it (what a worker sends to close the gap).
    processor.update_state(update(2, removed=[0], moved=[MovedRequest(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert banned_rows(processor, 2) == [[3], [2]]


def test_swaps_exchange_rows_also_with_an_empty_one():
    processor = make()
    processor.update_state(update(3, added=[added(0, [1]), added(1), added(2, [3])]))
    processor.update_state(update(3, moved=[MovedRequest(0, 2, MoveDirectionality.SWAP),
                                            MovedRequest(0, 1, MoveDirectionality.SWAP)]))
    assert banned_rows(processor, 3) == [[], [3], [1]]


def test_an_argmax_changing_processor_says_so():
    assert make().is_argmax_invariant() is False


# --- the record -----------------------------------------------------------------------------------


def test_the_first_apply_appends_one_record_line(tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AE_PLUGIN_RECORD", str(record))
    # No engine runs here, so there is no process role to read: stand in for the worker's.
    monkeypatch.setattr(ae_logits_example, "current_process_role", lambda: "worker rank 0")
    processor = make()
    processor.update_state(update(1, added=[added(0)]))
    processor.apply(torch.zeros(1, 4))
    processor.apply(torch.zeros(1, 4))
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert lines == [{"what": "logits processor apply", "pid": os.getpid(), "role": "worker rank 0"}]


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("AE_PLUGIN_RECORD", raising=False)
    processor = make()
    processor.update_state(update(1, added=[added(0)]))
    processor.apply(torch.zeros(1, 4))  # would raise reading the role if it tried to record
