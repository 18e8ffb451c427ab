"""The model runner's persistent input buffers (asyncengine/worker/input_batch.py)."""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.worker.input_batch import BlockTableRows, StagingBuffers


def test_rows_are_reused_grown_and_widened_without_losing_tables():
    rows = BlockTableRows(max_blocks_per_seq=3, initial_rows=2)
    first = rows.add([4, 5])
    second = rows.add([7])
    assert (first, second) == (0, 1)
    third = rows.add([9, 10, 11])  # no free row: the table doubles, earlier rows kept
    assert rows.table.shape[0] == 4 and third == 2
    rows.append(second, [8, 6, 2])  # past the width max_model_len foresaw: widened, rows kept
    assert rows.table.shape[1] >= 4
    assert rows.gather(np.array([first, second, third]), 4).tolist() == [[4, 5, 0, 0], [7, 8, 6, 2], [9, 10, 11, 0]]
    rows.release(first)
    reused = rows.add([1])  # a freed row is taken again, its old blocks overwritten from the start
    assert reused == first
    assert rows.gather(np.array([reused]), 1).tolist() == [[1]]
    assert rows.lengths[0, reused] == 1


def test_staging_arrays_grow_and_device_copies_do_not_alias_the_buffer():
    staging = StagingBuffers(torch.device("cpu"), pin_memory=False)
    staging.begin_step()
    staging.array("ids", 3, torch.int64)[:] = [1, 2, 3]
    sent = staging.to_device("ids", 3)
    staging.end_step()
    staging.array("ids", 3, torch.int64)[:] = 7  # the next step rewrites the same buffer
    assert sent.tolist() == [1, 2, 3]
    big = staging.array("ids", 1000, torch.int64)  # grows
    big[:] = 9
    assert staging.to_device("ids", 1000).shape == (1000,)
    assert staging.array("lens", 2, torch.int32).dtype == np.int32


def test_each_kv_cache_group_has_its_table_in_the_same_row():
    rows = BlockTableRows(max_blocks_per_seq=2, initial_rows=1, num_groups=2)
    first = rows.add([1, 2], [[7]])
    second = rows.add([3], [[8, 9]])  # grows the rows of both groups
    rows.append(first, [5], group=1)
    rows.append(second, [4, 6, 10], group=0)  # widens both groups
    assert rows.gather(np.array([first, second]), 3).tolist() == [[1, 2, 0], [3, 4, 6]]
    assert rows.gather(np.array([first, second]), 3, group=1).tolist() == [[7, 5, 0], [8, 9, 0]]
