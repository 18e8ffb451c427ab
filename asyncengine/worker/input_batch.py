"""The model runner's persistent input buffers: what it would otherwise rebuild from Python lists each step.

- `BlockTableRows`: each running request's block table is one row of a numpy array kept across steps.
  A new request takes a free row, a step that gives it new blocks appends them, a finished request
  frees its row. A step's `[num_seqs, width]` table is then one fancy-index of the rows it schedules,
  instead of a loop that copies every request's whole list of blocks.
- `StagingBuffers`: host arrays for the step's flat token inputs and per-sequence values, allocated
  once (in pinned memory on a GPU, so the copies to the device do not wait on the host) and grown when
  a step needs more. Each step writes its values at the front and sends exactly that prefix.

Reusing one pinned buffer across steps: a non-blocking copy from it is only queued on the device's
stream, so the host must not write the buffer again before the copy ran. Most steps end by reading the
sampled tokens back, which waits for the stream anyway; a step that samples nothing (a prompt chunk)
does not, so `begin_step` waits on an event recorded after the previous step's copies (free when they
are long done, which is almost always).
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTableRows:
    """Each running request's block tables, one row per request, one table per KV cache group (a model with
    sliding-window layers has several: asyncengine/wire/kv_cache.py); a request's row is the same in each."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64, num_groups: int = 1) -> None:
        self.tables = np.zeros((num_groups, initial_rows, max(1, max_blocks_per_seq)), dtype=np.int64)
        self.lengths = np.zeros((num_groups, initial_rows), dtype=np.int64)
        self._free = list(range(initial_rows - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def table(self) -> np.ndarray:
        """The first group's tables, `[rows, columns]`."""
        return self.tables[0]

    @property
    def num_groups(self) -> int:
        return self.tables.shape[0]

    def add(self, block_ids: list[int], extra_group_block_ids: list[list[int]] | None = None) -> int:
        if not self._free:
            self._grow(rows=2 * self.tables.shape[1])
        row = self._free.pop()
        self.lengths[:, row] = 0
        self.append(row, block_ids)
        for group, ids in enumerate(extra_group_block_ids or (), start=1):
            self.append(row, ids, group)
        return row

    def append(self, row: int, block_ids: list[int], group: int = 0) -> None:
        if not block_ids:
            return
        start = int(self.lengths[group, row])
        end = start + len(block_ids)
        if end > self.tables.shape[2]:  # longer than max_model_len foresaw (the profile run): widen
            self._grow(columns=max(end, 2 * self.tables.shape[2]))
        self.tables[group, row, start:end] = block_ids
        self.lengths[group, row] = end

    def truncate(self, row: int, length: int, group: int = 0) -> None:
        """Keep only the first `length` blocks of `row`'s table in `group`."""
        self.lengths[group, row] = min(int(self.lengths[group, row]), length)

    def release(self, row: int) -> None:
        self._free.append(row)

    def gather(self, rows: np.ndarray, width: int, group: int = 0) -> np.ndarray:
        """The tables of `rows`, `width` blocks each (columns past a request's blocks are stale: a
        kernel never reads past a sequence's context)."""
        return self.tables[group, rows, :width]

    def _grow(self, *, rows: int | None = None, columns: int | None = None) -> None:
        groups, old_rows, old_columns = self.tables.shape
        rows, columns = rows or old_rows, columns or old_columns
        tables = np.zeros((groups, rows, columns), dtype=np.int64)
        tables[:, :old_rows, :old_columns] = self.tables
        lengths = np.zeros((groups, rows), dtype=np.int64)
        lengths[:, :old_rows] = self.lengths
        self.tables, self.lengths = tables, lengths
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free


class StagingBuffers:
    """Named host arrays of at least a given length, views of (pinned, on a GPU) torch tensors."""

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._host: dict[str, torch.Tensor] = {}
        self._copies_queued: torch.cuda.Event | None = None

    def begin_step(self) -> None:
        """Wait until the previous step's copies have read the buffers (see the module's docstring)."""
        if self._copies_queued is not None:
            self._copies_queued.synchronize()
            self._copies_queued = None

    def end_step(self) -> None:
        """Mark the point after this step's copies; the next `begin_step` waits for it."""
        if self.pin_memory and self.device.type == "cuda":
            self._copies_queued = torch.cuda.Event()
            self._copies_queued.record()

    def array(self, name: str, length: int, dtype: torch.dtype) -> np.ndarray:
        """A writable numpy view of the first `length` elements of buffer `name`."""
        host = self._host.get(name)
        if host is None or host.numel() < length or host.dtype != dtype:
            capacity = max(length, 2 * host.numel() if host is not None else 256)
            host = torch.empty(capacity, dtype=dtype, pin_memory=self.pin_memory)
            self._host[name] = host
        return host[:length].numpy()

    def to_device(self, name: str, length: int) -> torch.Tensor:
        """The first `length` elements of buffer `name` on the device (a copy; on CPU, a fresh tensor
        too, since the buffer is rewritten next step while the step's tensors may still be held)."""
        host = self._host[name][:length]
        if self.device.type == "cpu":
            # numpy's copy, not torch's clone: a clone above 32k elements goes through the OpenMP pool,
            # which costs milliseconds when the other cores are busy (measured: 7.8 ms for 33k int64).
            return torch.from_numpy(host.numpy().copy())
        return host.to(self.device, non_blocking=self.pin_memory)
