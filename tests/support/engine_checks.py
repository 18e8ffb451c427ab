"""Checks shared by engine tests."""

from __future__ import annotations

from asyncengine.wire.engine_core import SchedulerStats


def assert_all_blocks_free(stats: SchedulerStats) -> None:
    """Nothing running or waiting, and no KV block referenced: nothing leaked."""
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0), stats
    assert stats.kv_cache_usage == 0.0, stats
