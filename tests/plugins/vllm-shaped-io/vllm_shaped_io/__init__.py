"""vllm_shaped_io: late-interaction (MaxSim) ranking of documents against a query, from per-token embeddings."""


def get_processor_cls():
    return "vllm_shaped_io.processor.MaxSimProcessor"
