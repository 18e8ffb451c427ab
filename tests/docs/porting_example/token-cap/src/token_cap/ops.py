"""RecordingSiluAndMul replaces the in-tree SiluAndMul op of every model the worker builds."""

import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp

from token_cap import note


@CustomOp.register_oot(name="SiluAndMul")
class RecordingSiluAndMul(CustomOp):
    noted = False

    def forward_native(self, x):
        if not RecordingSiluAndMul.noted:
            RecordingSiluAndMul.noted = True
            note("silu_and_mul")
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    def forward_cuda(self, x):
        return self.forward_native(x)
