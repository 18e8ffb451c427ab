"""MaxSimProcessor: `data: {"query": [ids], "documents": [[ids], ...], "top_n": N}` in; each document's MaxSim
score against the query (for every query token, its best dot product with a document token, summed) and the
top N documents out, as pydantic models."""

from collections.abc import Sequence

import torch
from pydantic import BaseModel, Field

from vllm.config import VllmConfig
from vllm.inputs.data import PromptType, TokensPrompt
from vllm.logger import init_logger
from vllm.outputs import PoolingRequestOutput
from vllm.plugins.io_processors.interface import IOProcessor
from vllm.pooling_params import PoolingParams

logger = init_logger(__name__)


class MaxSimRequest(BaseModel):
    query: list[int] = Field(min_length=1)
    documents: list[list[int]] = Field(min_length=1)
    top_n: int = Field(default=2, ge=1)


class ScoredDocument(BaseModel):
    index: int
    score: float
    num_tokens: int


class MaxSimResponse(BaseModel):
    request_id: str | None
    scores: list[float]
    top: list[ScoredDocument]


class MaxSimProcessor(IOProcessor[MaxSimRequest, MaxSimResponse]):
    def __init__(self, vllm_config: VllmConfig, renderer=None):
        super().__init__(vllm_config, renderer)
        self.top_n: dict[str | None, int] = {}  # per request, from pre_process to post_process

    def parse_data(self, data: object) -> MaxSimRequest:
        return MaxSimRequest.model_validate(data)  # a pydantic ValidationError is a ValueError: the client's 400

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        if params is None:
            params = PoolingParams()
        params.task = "token_embed"
        return params

    def pre_process(self, prompt: MaxSimRequest, request_id: str | None = None, **kwargs) -> Sequence[PromptType]:
        self.top_n[request_id] = min(prompt.top_n, len(prompt.documents))
        return [TokensPrompt(prompt_token_ids=ids) for ids in [prompt.query, *prompt.documents]]

    def post_process(self, model_output: Sequence[PoolingRequestOutput], request_id: str | None = None,
                     **kwargs) -> MaxSimResponse:
        query, *documents = [torch.as_tensor(output.outputs.data, dtype=torch.float32) for output in model_output]
        scores = [float((query @ document.T).max(dim=1).values.sum()) for document in documents]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:self.top_n.pop(request_id)]
        logger.debug("request %s: ranked %d documents", request_id, len(documents))
        return MaxSimResponse(request_id=request_id, scores=scores,
                              top=[ScoredDocument(index=i, score=scores[i], num_tokens=documents[i].shape[0])
                                   for i in order])
