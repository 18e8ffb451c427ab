"""Loading the tokenizer and rendering chat prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncengine.errors import ModelLoadError, RequestError


def load_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer from a local directory (never a hub download)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a tokenizer from {path}: {exc}. Pass --tokenizer DIR, or skip_tokenizer_init=True "
            "to send token ids only"
        ) from exc


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
