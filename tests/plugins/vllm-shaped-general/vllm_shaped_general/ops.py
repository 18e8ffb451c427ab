"""ChunkedSiluAndMul: silu(gate) * up over chunks of VLLM_SHAPED_CHUNK_ROWS rows (a knob of this plugin's own,
default 3), so that a long prompt never needs the whole intermediate at once."""

import os

import torch
import torch.nn.functional as F

import vllm.envs as envs
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.utils import cdiv, round_up

from vllm_shaped_general import note

logger = init_logger(__name__)
CHUNK_ROWS = int(os.environ.get("VLLM_SHAPED_CHUNK_ROWS", "3"))


@CustomOp.register_oot(name="SiluAndMul")
class ChunkedSiluAndMul(CustomOp):
    group_checked = False

    def forward_native(self, x):
        if not ChunkedSiluAndMul.group_checked:
            ChunkedSiluAndMul.group_checked = True
            self._check_group()
        half = x.shape[-1] // 2
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], half, dtype=x.dtype, device=x.device)
        num_chunks = cdiv(rows.shape[0], CHUNK_ROWS)
        for chunk in range(num_chunks):
            start, end = chunk * CHUNK_ROWS, min((chunk + 1) * CHUNK_ROWS, rows.shape[0])
            out[start:end] = F.silu(rows[start:end, :half]) * rows[start:end, half:]
        return out.reshape(*x.shape[:-1], half)

    @staticmethod
    def _check_group():
        # Every rank reaches its first MLP in the same forward pass, so this collective meets its peers.
        rank = get_tensor_model_parallel_rank()
        world_size = get_tensor_model_parallel_world_size()
        ranks_seen = tensor_model_parallel_all_reduce(torch.ones(1))
        logger.info("ChunkedSiluAndMul on rank %d of %d (logging level %s)", rank, world_size,
                    envs.VLLM_LOGGING_LEVEL)
        note(what="group", rank=rank, world_size=world_size, ranks_seen=int(ranks_seen.item()),
             padded_rows=round_up(CHUNK_ROWS, 8))
