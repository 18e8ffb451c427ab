"""A model loader that fills every weight from the checkpoint, then records where it ran (the file
named by AE_PLUGIN_RECORD): the worker builds the model, so that is where it must run."""

import json
import os

from asyncengine.plugins_api import SafetensorsLoader, current_process_role, register_model_loader


class RecordingSafetensorsLoader(SafetensorsLoader):
    def load_weights(self, model, model_config):
        super().load_weights(model, model_config)
        with open(os.environ["AE_PLUGIN_RECORD"], "a") as file:
            file.write(json.dumps({"what": "model loader", "pid": os.getpid(), "role": current_process_role(),
                                   "format": self.load_config.load_format}) + "\n")


def register():
    register_model_loader("ae_recording")(RecordingSafetensorsLoader)
