"""The bodies of the pooling routes as msgspec Structs, in vLLM's shapes (and OpenAI's for /v1/embeddings,
Jina's and Cohere's for /rerank). Requests forbid unknown fields, as the rest of the API does.

`input` takes what OpenAI's embeddings API takes: a string, a list of strings, a list of token ids, or a list
of lists of token ids (typed two lists deep at most, so a deeper nesting stops msgspec at once).
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec

from asyncengine.sampling_params import INT64_MAX
from asyncengine.server.protocol import TokenId, TokenIds

# (msgspec takes one array type per union: the list's items say which shape it is, checked in serving_pooling.)
EmbeddingInput = str | Annotated[list[str | TokenId | TokenIds], msgspec.Meta(min_length=1)]
# -1: truncate to max_model_len; 0 is refused by PoolingParams (a JSON schema range cannot leave out one value)
TruncateTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]


class _PoolingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    add_special_tokens: bool = True
    user: str | None = None  # OpenAI's end-user id: accepted, used for nothing (as OpenAI's own server may)


class EmbeddingRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    normalize: bool | None = None


class PoolingRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /pooling: the pooler's raw output per input (`task` "encode"), or, with an IO processor chosen by
    --io-processor-plugin, `data` for the plugin (vLLM's shape)."""

    input: EmbeddingInput | None = None
    data: Any = None
    task: Literal["encode", "embed", "classify", "token_embed", "token_classify", "plugin"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    input: EmbeddingInput


class ScoreRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    query: str
    documents: list[str]
    top_n: Positive | None = None  # the best top_n documents (all of them when unset or larger)
    return_documents: bool = True


class PoolingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class _Answer(msgspec.Struct, kw_only=True):
    """The fields every pooling response but /rerank's starts with (each adds its `data` and `usage`)."""

    id: str
    created: int
    model: str


Item = TypeVar("Item")


class _ListOf(_Answer, Generic[Item], kw_only=True):
    """OpenAI's list object: one item per input, in input order."""

    data: list[Item]
    usage: PoolingUsage
    object: str = "list"


class _Item(msgspec.Struct, kw_only=True):
    """One input's result in a response's `data`, by its position among the inputs."""

    index: int


class EmbeddingData(_Item, kw_only=True):
    embedding: list[float] | str  # str: base64 of the float32 little-endian values
    object: str = "embedding"


class EmbeddingResponse(_ListOf[EmbeddingData], kw_only=True):
    pass


class PoolingData(_Item, kw_only=True):
    data: Any  # the pooled tensor as nested lists of floats, or base64 of its float32 values
    object: str = "pooling"


class PoolingResponse(_Answer, kw_only=True, tag_field="object", tag="list"):
    # (tagged by `object`, as it is written anyway, so that the route's two answers make one schema)
    data: list[PoolingData]
    usage: PoolingUsage


class PoolingIOResponse(_Answer, kw_only=True, tag_field="object", tag="io_process"):
    """POST /pooling with an IO processor: what its post_process made of the pooled outputs."""

    plugin: str
    data: Any
    usage: PoolingUsage


class ClassificationData(_Item, kw_only=True):
    label: str | None
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationResponse(_ListOf[ClassificationData], kw_only=True):
    pass


class ScoreData(_Item, kw_only=True):
    score: float
    object: str = "score"


class ScoreResponse(_ListOf[ScoreData], kw_only=True):
    pass


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
