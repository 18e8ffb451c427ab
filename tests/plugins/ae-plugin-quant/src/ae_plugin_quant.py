"""A quantization method ("ae_fake_quant") that keeps float weights, counts the linear layers it builds,
and records where it ran (the file named by AE_PLUGIN_RECORD): the worker builds the model, so that is
where it must run."""

import json
import os

from asyncengine.plugins_api import (
    LinearMethod,
    QuantizationConfig,
    current_process_role,
    register_quantization_config,
)


class FakeLinearMethod(LinearMethod):
    def create_weights(self, layer, input_size, output_size, params_dtype):
        import torch

        layer.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                          requires_grad=False)

    def load_weight_rows(self, layer, row_offset, rows):
        layer.weight.data.narrow(0, row_offset, rows.shape[0]).copy_(rows)

    def apply(self, layer, x, bias=None):
        import torch.nn.functional as F

        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer):
        layer.fake_quant_processed = True


class FakeQuantConfig(QuantizationConfig):
    def __init__(self):
        self.layers = 0

    @classmethod
    def get_name(cls):
        return "ae_fake_quant"

    def get_quant_method(self, layer, prefix):
        self.layers += 1
        with open(os.environ["AE_PLUGIN_RECORD"], "a") as file:
            file.write(json.dumps({"what": "quantization", "pid": os.getpid(), "role": current_process_role(),
                                   "layer": type(layer).__name__}) + "\n")
        return FakeLinearMethod()


def register():
    register_quantization_config("ae_fake_quant")(FakeQuantConfig)
