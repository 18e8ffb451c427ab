"""The bodies of the pooling routes as msgspec Structs, in vLLM's shapes (and OpenAI's for /v1/embeddings,
Jina's and Cohere's for /rerank). Requests forbid unknown fields, as the rest of the API does.

`input` takes what OpenAI's embeddings API takes: a string, a list of strings, a list of token ids, or a list
of lists of token ids (typed two lists deep at most, so a deeper nesting stops msgspec at once).
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec

from asyncengine.sampling_bounds import PositiveCount, TokenId, TruncatePromptTokens
from asyncengine.server.protocol import TokenIds

# (msgspec takes one array type per union: the list's items say which shape it is, checked in serving_pooling.)
EmbeddingInput = str | Annotated[list[str | TokenId | TokenIds], msgspec.Meta(min_length=1)]


class _PoolingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # -1: max_model_len; 0 refused by PoolingParams
    add_special_tokens: bool = True
    user: str | None = None  # OpenAI's end-user id: accepted, used for nothing (as OpenAI's own server may)


class EmbeddingRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveCount | None = None
    normalize: bool | None = None


class PoolingRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /pooling: the pooler's raw output per input (`task` "encode"), or, with an IO processor chosen by
    --io-processor-plugin, `data` for the plugin (vLLM's shape)."""

    input: EmbeddingInput | None = None
    data: Any = None
    task: Literal["encode", "embed", "classify", "token_embed", "token_classify", "plugin"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveCount | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    input: EmbeddingInput


ScoreTexts = str | list[str]


class ScoreRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """POST /score and /v1/score: one pair of fields, by any of vLLM's names for it (`text_1`/`text_2`,
    `queries`/`documents`, `queries`/`items`, `data_1`/`data_2`); `score_pair` says which was sent."""

    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None


# vLLM's names of a score request's two sides, in the order it tries them.
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class RerankRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    query: str
    documents: list[str]
    top_n: PositiveCount | None = None  # the best top_n documents (all of them when unset or larger)
    return_documents: bool = True


# Cohere's embedding types (its v2 embed API): float, base64 (of the float32 little-endian values, as
# OpenAI's), and binary/ubinary (one sign bit per dimension, packed 8 to a byte). int8 and uint8 need
# Cohere's calibration ranges, which are not published: refused (serving_pooling.py says so).
CohereEmbeddingType = Literal["float", "base64", "binary", "ubinary", "int8", "uint8"]


class CohereEmbedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v2/embed: Cohere's v2 embed API over texts (`images` and `inputs` are not taken: a text model)."""

    model: str | None = None
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    # What the text is for: Cohere's models prepend a task prompt by it; the models served here have no
    # such prompts, so it changes nothing (docs/coming_from_vllm.md).
    input_type: Literal["search_document", "search_query", "classification", "clustering"] | None = None
    embedding_types: Annotated[list[CohereEmbeddingType], msgspec.Meta(min_length=1)] = \
        msgspec.field(default_factory=lambda: ["float"])
    output_dimension: PositiveCount | None = None
    # NONE and END refuse a text past the context (END, cutting the text's end, is not built); START keeps
    # its last tokens, `max_tokens` of them when set.
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: PositiveCount | None = None


class CohereBilledUnits(msgspec.Struct, kw_only=True):
    input_tokens: int


class CohereApiVersion(msgspec.Struct, kw_only=True):
    version: str = "2"


class CohereMeta(msgspec.Struct, kw_only=True):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits


class CohereEmbeddings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One list per type asked for, each with one embedding per text (only those asked for are sent)."""

    floats: list[list[float]] | None = msgspec.field(default=None, name="float")  # (`float` would shadow the type)
    base64: list[str] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None


class CohereEmbedResponse(msgspec.Struct, kw_only=True):
    id: str
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereMeta
    response_type: str = "embeddings_by_type"


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
