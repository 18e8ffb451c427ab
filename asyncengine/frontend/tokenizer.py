"""Loading the tokenizer and rendering chat prompts.

`tokenizer_mode` picks the tokenizer class from TokenizerRegistry (EXTENSION_POINTS.md, R9): "auto" is
transformers' AutoTokenizer; a plugin adds a mode with `TokenizerRegistry.register("mode", "pkg.mod:Class")`.
Read in the frontend only (it tokenizes prompts and detokenizes outputs). The class is built as
`Class.from_pretrained(path)`, as in vLLM; what the engine calls on it is in docs/plugins.md ("Tokenizers").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncengine.errors import ConfigError, ModelLoadError, RequestError
from asyncengine.registries.base import BUILT_IN, Registry, describe, reads

AUTO = "auto"
# What the engine calls on every tokenizer; the rest (apply_chat_template, chat_template, eos_token_id) is optional.
REQUIRED_METHODS = ("encode", "decode")


class HFAutoTokenizer:
    """The "auto" mode: a transformers tokenizer from a local directory (never a hub download)."""

    @classmethod
    def from_pretrained(cls, path: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class _TokenizerRegistry(Registry):
    def __init__(self) -> None:
        super().__init__("tokenizers", "tokenizer mode")
        self.register(AUTO, HFAutoTokenizer, owner=BUILT_IN)


TokenizerRegistry = _TokenizerRegistry()


@reads("tokenizers", "frontend")
def tokenizer_class(mode: str) -> Any:
    """The class registered for `mode`; an unknown mode lists the known ones."""
    from asyncengine.models.registry import import_by_path

    entry = TokenizerRegistry.get(mode)
    if entry is None:
        raise ConfigError(f"tokenizer_mode {mode!r} names no tokenizer; known: {', '.join(TokenizerRegistry.keys())} "
                          "(a plugin adds one with TokenizerRegistry.register(\"mode\", \"pkg.mod:Class\"))",
                          field="tokenizer_mode")
    implementation = entry.implementation
    if isinstance(implementation, str):
        try:
            implementation = import_by_path(implementation, what=f"tokenizer mode {mode!r}")
        except ModelLoadError as exc:
            raise ConfigError(str(exc), field="tokenizer_mode") from exc
    if not callable(getattr(implementation, "from_pretrained", None)):
        raise ConfigError(f"tokenizer mode {mode!r}: {describe(implementation)} has no from_pretrained(path) "
                          "class method", field="tokenizer_mode")
    return implementation


def load_tokenizer(path: str | Path, mode: str = AUTO) -> Any:
    """The tokenizer of `mode`, built as `Class.from_pretrained(path)`; it must have encode and decode."""
    cls = tokenizer_class(mode)
    try:
        tokenizer = cls.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a tokenizer from {path}: {exc}. Pass --tokenizer DIR, or skip_tokenizer_init=True "
            "to send token ids only"
        ) from exc
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(tokenizer, name, None))]
    if missing:
        raise ConfigError(f"tokenizer mode {mode!r}: {describe(cls)}.from_pretrained returned "
                          f"{type(tokenizer).__qualname__}, which has no {' or '.join(missing)} method",
                          field="tokenizer_mode")
    return tokenizer


def read_chat_template(value: str | None) -> str | None:
    """`chat_template` may be a Jinja template or the path of a file holding one."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ModelLoadError(f"chat_template {value!r} is neither a readable file nor a Jinja template")
    return value


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None, *,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text for a conversation, through the tokenizer's chat template or `chat_template`;
    `template_kwargs` (`tools`, a request's `chat_template_kwargs`) reach the template as variables."""
    if tokenizer is None:
        raise RequestError("chat needs a tokenizer, but the engine runs with skip_tokenizer_init", field="messages")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise RequestError(
            "the model's tokenizer has no chat template: pass chat_template (a Jinja template or a file)",
            field="messages",
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} objects", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] has no 'role' string", field=f"messages[{index}].role")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except TemplateError as exc:
        raise RequestError(f"the chat template failed on these messages: {exc}", field="messages") from exc
