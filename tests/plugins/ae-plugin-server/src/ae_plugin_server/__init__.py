"""Server-side test plugins. Each appends a JSON line {"what", "pid", "role", ...} to the file named by
AE_PLUGIN_RECORD, so a test can check which process ran its code."""

import json
import os

import anyio

from asyncengine.plugins_api import EndpointPlugin, StatLoggerBase, current_process_role


def record(what, **extra):
    with open(os.environ["AE_PLUGIN_RECORD"], "a") as file:
        file.write(json.dumps({"what": what, "pid": os.getpid(), "role": current_process_role(), **extra}) + "\n")


class Hello(EndpointPlugin):
    name = "hello"

    def attach(self, app):
        @app.get("/hello")
        async def hello():
            record("endpoint route")
            return {"hello": "from a plugin", "pid": os.getpid()}

    async def serve(self, engine_client, task_status=anyio.TASK_STATUS_IGNORED):
        record("endpoint background task", model=engine_client.model_config.served_model_name)
        task_status.started()
        await anyio.sleep_forever()  # background work lives as long as the server


def make_endpoint():
    return Hello()


class RecordingStatLogger(StatLoggerBase):
    def __init__(self, engine_config=None):
        super().__init__(engine_config)
        self.generation_tokens = 0
        self.recorded = False

    def record(self, scheduler_stats, iteration_stats):
        self.generation_tokens += iteration_stats.num_generation_tokens if iteration_stats else 0
        if not self.recorded or (iteration_stats and iteration_stats.finished_requests):
            self.recorded = True
            record("stat logger", generation_tokens=self.generation_tokens)
