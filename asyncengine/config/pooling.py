"""Which runner a model gets, and its pooler, from the options and the model's files.

`runner="auto"` picks pooling for an architecture that has no language-model head (`BertModel`,
`XLMRobertaModel`, `Qwen3Model`, ...), a classifier (`*ForSequenceClassification`) or a registered class
that says `is_pooling_model = True`; otherwise generation. The pooler of a pooling model comes, in order,
from `--pooler-config` (its keys: `pooling_type`, `normalize`), from sentence-transformers' files
(modules.json naming a Pooling module, whose config.json gives the mode, and a Normalize module), else from
the architecture: CLS for BERT-family encoders, LAST for decoders (the shapes of Qwen3-Embedding and
gte-Qwen2). A classifier keeps its own head (the model class's `pooler`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from asyncengine.errors import ConfigError, ModelLoadError

RUNNERS = ("auto", "generate", "pooling")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta", "roberta")
_POOLING_SUFFIXES = ("Model", "ForSequenceClassification", "ForEmbedding", "EmbeddingModel")

# sentence-transformers' Pooling module: its config flag -> our pooling type.
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The pooler the worker builds: `pooling_type` (a PoolerRegistry key; None: the classifier's own head),
    `normalize` (the default of PoolingParams.normalize), `source` (what chose it, for the start-up report),
    `is_classifier` (the model scores classes), `num_labels`, `matryoshka` (may `dimensions` truncate)."""

    pooling_type: str | None
    normalize: bool
    source: str
    is_classifier: bool = False
    num_labels: int = 0
    matryoshka: bool = False
    # sentence-transformers' max_seq_length, where its files give one (its model truncates there).
    max_seq_length: int | None = None


def check_runner(runner: str) -> None:
    if runner not in RUNNERS:
        raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}", field="runner")


def check_pooler_config(value: dict[str, Any] | None) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError('pooler_config must be a JSON object, as {"pooling_type": "MEAN", "normalize": true}',
                          field="pooler_config")
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"pooler_config has unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(POOLER_CONFIG_KEYS)}", field="pooler_config")
    kind = value.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise ConfigError("pooler_config's pooling_type must name a pooler (LAST, MEAN, CLS, ALL or a registered "
                          "one)", field="pooler_config")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise ConfigError("pooler_config's normalize must be true or false", field="pooler_config")


def is_pooling_architecture(architecture: str, model_class: Any = None) -> bool:
    """`auto`'s rule: a registered class that says so, else a name with no language-model head."""
    flag = getattr(model_class, "is_pooling_model", None)
    if isinstance(flag, bool):
        return flag
    return architecture.endswith(_POOLING_SUFFIXES)


def resolve_runner(runner: str, architectures: list[str], model_class: Any = None) -> str:
    if runner != "auto":
        return runner
    return "pooling" if any(is_pooling_architecture(a, model_class) for a in architectures) else "generate"


def resolve_pooler_config(option: dict[str, Any] | None, model_dir: Path, hf_config: dict[str, Any],
                          architectures: list[str]) -> PoolerConfig:
    """The pooler of a pooling model (see the module's docstring for the order)."""
    is_classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    num_labels = _num_labels(hf_config) if is_classifier else 0
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    st = _sentence_transformers_pooler(model_dir)
    max_seq_length = _st_max_seq_length(model_dir)
    option = option or {}
    if option.get("pooling_type") is not None:
        kind, source = option["pooling_type"], "--pooler-config"
    elif is_classifier:
        kind, source = None, "the model's classification head"
    elif st is not None:
        kind, source = st[0], "sentence-transformers' modules.json"
    else:
        encoder = hf_config.get("model_type") in ENCODER_MODEL_TYPES
        kind, source = ("CLS" if encoder else "LAST"), f"the default for a {'encoder' if encoder else 'decoder'}"
    normalize = option.get("normalize")
    if normalize is None:
        normalize = st[1] if st is not None else not is_classifier
    return PoolerConfig(pooling_type=kind, normalize=bool(normalize), source=source, is_classifier=is_classifier,
                        num_labels=num_labels, matryoshka=matryoshka, max_seq_length=max_seq_length)


def _num_labels(hf_config: dict[str, Any]) -> int:
    labels = hf_config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(hf_config.get("num_labels") or 2)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _sentence_transformers_pooler(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and its Pooling module's config, or None without one."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file} must hold a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    unsupported = [t for t in types if t.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ModelLoadError(f"{modules_file} names sentence-transformers module(s) {', '.join(unsupported)}, which "
                             "asyncengine does not run (it runs Transformer, Pooling and Normalize); "
                             "pass --pooler-config to choose a pooler and drop them knowingly")
    normalize = any(t.endswith(".Normalize") for t in types)
    if pooling is None:
        return None
    config_file = model_dir / str(pooling.get("path", "")) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{modules_file} names a Pooling module at {config_file.parent}, which has no config.json")
    config = _read_json(config_file)
    chosen = [kind for flag, kind in _ST_MODES.items() if config.get(flag)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(chosen) != 1:
        raise ModelLoadError(f"{config_file} asks for pooling {', '.join(others + chosen) or '(none)'}; asyncengine "
                             "pools by one of cls_token, mean_tokens, lasttoken: pass --pooler-config to choose")
    return chosen[0], normalize


def _st_max_seq_length(model_dir: Path) -> int | None:
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = _read_json(path)
    length = value.get("max_seq_length") if isinstance(value, dict) else None
    return length if isinstance(length, int) and length > 0 else None


DEFAULT_POOLING_MODEL_NAME = "all-MiniLM-L6-v2"


def apply_pooling(config: Any, model_config: Any, architectures: Any = None) -> Any:
    """`model_config` (a ModelConfig) with its runner and, for a pooling model, its pooler: the max_model_len
    is capped at sentence-transformers' max_seq_length unless the option set one, and the default pooling
    model is served under its own name. `architectures`: the model registry (its `get` and `resolve`), which
    the frontend hands in; the config sits below it."""
    names = list(model_config.architectures)
    registered = None
    lookup = getattr(architectures, "get", None)
    if lookup is not None and config.runner == "auto":
        for name in names:
            entry = lookup(name)
            if entry is None:
                continue
            registered = entry.implementation
            if isinstance(registered, str):
                if registered.startswith("asyncengine."):  # ours: the name says which runner
                    registered = None
                else:  # a plugin's class, by path: only it knows whether it pools (`is_pooling_model`);
                    # the table imports it (ModelLoadError naming the architecture), the config stays below it
                    registered = architectures.resolve([name])[1]
            break
    runner = resolve_runner(config.runner, names, registered)
    if runner != "pooling":
        if config.pooler_config is not None:
            raise ConfigError("pooler_config applies to pooling models only: add --runner pooling (the model's "
                              f"architecture {', '.join(names)} runs as a generation model)", field="pooler_config")
        # A generation model also embeds (its last token, normalized), batched with generation in the same steps,
        # unless its files ask for a pooling it cannot do: then embedding requests are refused, naming why.
        try:
            pooler: PoolerConfig | None = resolve_pooler_config(None, Path(model_config.model_dir),
                                                                model_config.hf_config, names)
        except ModelLoadError:
            pooler = None
        return msgspec.structs.replace(model_config, runner=runner, pooler=pooler)
    pooler = resolve_pooler_config(config.pooler_config, Path(model_config.model_dir), model_config.hf_config, names)
    max_model_len = model_config.max_model_len
    if config.max_model_len is None and pooler.max_seq_length is not None:
        max_model_len = min(max_model_len, pooler.max_seq_length)
    served = model_config.served_model_name
    if config.model is None and config.served_model_name is None:
        served = DEFAULT_POOLING_MODEL_NAME
    return msgspec.structs.replace(model_config, runner=runner, pooler=pooler, max_model_len=max_model_len,
                                   served_model_name=served)
