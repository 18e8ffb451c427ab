"""CountingStatLogger: vLLM's stat-logger signatures. `record` declares mm_cache_stats without a default
(vLLM passes every argument by keyword), `__init__` takes engine_index. At exit it writes what it saw
to the file STATS_RECORD names."""

import atexit
import json
import os

from vllm.v1.metrics.loggers import StatLoggerBase


class CountingStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index=0):
        self.vllm_config = vllm_config
        self.engine_index = engine_index
        self.records = 0
        self.engine_indexes = set()
        self.mm_cache_stats = set()
        self.initialized = 0
        atexit.register(self._write)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx=0):
        self.records += 1
        self.engine_indexes.add(engine_idx)
        self.mm_cache_stats.add(repr(mm_cache_stats))

    def log(self):
        pass

    def log_engine_initialized(self):
        self.initialized += 1

    def _write(self):
        path = os.environ.get("STATS_RECORD")
        if path:
            with open(path, "w", encoding="utf-8") as record:
                json.dump({"records": self.records, "engine_indexes": sorted(self.engine_indexes),
                           "mm_cache_stats": sorted(self.mm_cache_stats), "initialized": self.initialized,
                           "engine_index": self.engine_index,
                           "max_num_seqs": self.vllm_config.scheduler_config.max_num_seqs}, record)


class MinimalStatLogger(StatLoggerBase):
    """vLLM's own test logger's shapes: __init__ takes engine_idx, record takes engine_idx and no
    mm_cache_stats. It notes its last engine_idx in the file STATS_RECORD names, suffixed .minimal."""

    def __init__(self, vllm_config, engine_idx=0):
        self.vllm_config = vllm_config
        self.engine_idx = engine_idx
        self.recorded = []
        self.logged = False
        self.engine_initialized = False
        atexit.register(self._write)

    def record(self, scheduler_stats, iteration_stats, engine_idx):
        self.recorded.append((scheduler_stats, iteration_stats, engine_idx))

    def log(self):
        self.logged = True

    def log_engine_initialized(self):
        self.engine_initialized = True

    def _write(self):
        path = os.environ.get("STATS_RECORD")
        if path:
            with open(path + ".minimal", "w", encoding="utf-8") as record:
                json.dump({"records": len(self.recorded), "engine_idx": sorted({r[2] for r in self.recorded}),
                           "engine_initialized": self.engine_initialized}, record)
