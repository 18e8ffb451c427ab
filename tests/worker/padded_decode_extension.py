"""A worker extension (C3) for tests/worker/test_decode_graphs.py: switches the model runner to the padded
static-buffer decode path of asyncengine/worker/cuda_graphs.py, uncaptured (CPU has no CUDA graphs), and
reports which padded batch sizes the decode steps ran at."""

from __future__ import annotations


class PaddedDecode:
    def __init__(self, worker) -> None:
        self.worker = worker

    def use_padded_decode(self) -> list[int]:
        runner = self.worker.model_runner
        runner.enable_decode_graphs(capture=False)
        return runner.decode_graphs.sizes

    def padded_decode_runs(self) -> list[list[int]]:
        """[sequences, padded size, steps] per kind of decode step run so far."""
        return [[n, size, count] for (n, size), count in self.worker.model_runner.decode_graphs.runs.items()]
