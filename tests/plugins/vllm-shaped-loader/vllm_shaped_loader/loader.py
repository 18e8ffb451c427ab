"""AccountingLoader: the checkpoint's tensors, fed to the model's load_weights, with a count of what went in.
model_loader_extra_config: {"record": PATH} appends one JSON line per load there; {"skip": [NAME, ...]} leaves
those tensors out (the model then keeps what it was built with). Other keys are refused."""

import glob
import json
import os

from torch import nn

from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

logger = init_logger(__name__)
KNOWN_KEYS = {"record", "skip"}


@register_model_loader("shaped_safetensors")
class AccountingLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        unknown = set(extra) - KNOWN_KEYS
        if unknown:
            raise ValueError(f"Unexpected model_loader_extra_config keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
        self.record = extra.get("record")
        self.skip = set(extra.get("skip", []))

    def _weight_files(self, model_config: ModelConfig):
        files = sorted(glob.glob(os.path.join(model_config.model, "*.safetensors")))
        if not files:
            raise RuntimeError(f"no *.safetensors in {model_config.model}")
        return files

    def download_model(self, model_config: ModelConfig) -> None:
        self._weight_files(model_config)  # a local folder only: nothing to fetch, but it must hold the weights

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        loaded, skipped = [], []

        def weights():
            for name, tensor in safetensors_weights_iterator(self._weight_files(model_config),
                                                             self.load_config.use_tqdm_on_load):
                if name in self.skip:
                    skipped.append(name)
                    continue
                loaded.append(name)
                yield name, tensor

        model.load_weights(weights())
        logger.info("loaded %d tensors (%d skipped)", len(loaded), len(skipped))
        if self.record:
            with open(self.record, "a", encoding="utf-8") as file:
                file.write(json.dumps({"pid": os.getpid(), "rank": get_tensor_model_parallel_rank(),
                                       "world_size": get_tensor_model_parallel_world_size(),
                                       "load_format": self.load_config.load_format, "loaded": len(loaded),
                                       "skipped": skipped}) + "\n")
