"""DeepWorker: vLLM's CPU worker, with its own device initialisation and memory budget."""

import os

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_shaped_deep import failing

logger = init_logger(__name__)


class DeepWorker(CPUWorker):
    def init_device(self):
        if failing("init_device"):
            raise RuntimeError(f"rank {self.rank}: the DeepDevice runtime is not loaded")
        super().init_device()
        record = os.environ.get("DEEP_RECORD")
        if record:
            with open(record, "a", encoding="utf-8") as file:
                file.write(f"init_device rank={self.rank} local_rank={self.local_rank} "
                           f"tp={self.parallel_config.tensor_parallel_size}\n")

    def determine_available_memory(self):
        return super().determine_available_memory()
