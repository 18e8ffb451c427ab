"""Loading the tokenizer and rendering chat prompts.

`tokenizer_mode` picks the tokenizer class from TokenizerRegistry (docs/reference.md, tokenizers; the table
is in the floor, asyncengine.interfaces.tokenizer): "auto" is transformers' AutoTokenizer; a plugin adds a mode with `TokenizerRegistry.register("mode", "pkg.mod:Class")`.
Read in the frontend only (it tokenizes prompts and detokenizes outputs). The class is built as
`Class.from_pretrained(path)`, as in vLLM; what the engine calls on it is in docs/plugins.md ("Tokenizers").
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from asyncengine.errors import ConfigError, ModelLoadError, RequestError
from asyncengine.frontend.chat_messages import conversation_for_template
from asyncengine.interfaces.registry import describe, reads

# The table is in the floor (a plugin fills it in every process), with "auto" naming HFAutoTokenizer
# below by path.
from asyncengine.interfaces.tokenizer import AUTO, TokenizerRegistry

# What the engine calls on every tokenizer; the rest (apply_chat_template, chat_template, eos_token_id) is optional.
REQUIRED_METHODS = ("encode", "decode")


class HFAutoTokenizer:
    """The "auto" mode: a transformers tokenizer from a local directory (never a hub download)."""

    @classmethod
    def from_pretrained(cls, path: str, *, trust_remote_code: bool = False) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)



@reads("tokenizers", "frontend")
def tokenizer_class(mode: str) -> Any:
    """The class registered for `mode`; an unknown mode lists the known ones."""
    return TokenizerRegistry.load(mode)


def load_tokenizer(path: str | Path, mode: str = AUTO, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `mode`, built as `Class.from_pretrained(path)` (with `trust_remote_code=True` when set,
    as vLLM passes it); it must have encode and decode."""
    cls = tokenizer_class(mode)
    try:
        tokenizer = cls.from_pretrained(str(path), **({"trust_remote_code": True} if trust_remote_code else {}))
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


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, for the tokenizer pool's threads. A transformers fast tokenizer is called
    through its Rust tokenizer (`encode_batch_fast`: ids without offsets), which releases the GIL while
    it tokenizes; its own `encode` builds offsets and masks for the whole text under the GIL, and a thread
    holding the GIL stalls the event loop just as a call on the loop would (for a 1 MB prompt: a tenth
    of a second and more, against a few milliseconds)."""
    backend = _direct_backend(tokenizer)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def decode_ids(tokenizer: Any, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
    """`tokenizer.decode(token_ids)`, for the tokenizer pool's threads: through `decode_batch`, which
    releases the GIL (`decode` holds it for the whole text), when that gives the same text."""
    backend = _direct_backend(tokenizer)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]


def _direct_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer under a transformers fast tokenizer, when calling it directly is what the
    tokenizer's encode would do: no truncation or padding set on it, special tokens split as the
    tokenizer says (transformers sets both on every encode). Else None: use the tokenizer's methods."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    backend = tokenizer.backend_tokenizer
    if not (hasattr(backend, "encode_batch_fast") and hasattr(backend, "decode_batch")):
        return None  # tokenizers older than 0.21
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


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


# Arguments of apply_chat_template that are not template variables: the engine sets them (or they
# make no sense for a prompt rendered to text), so a request's chat_template_kwargs may not.
# `add_generation_prompt`, `continue_final_message`, `tools` and `documents` may be set there, as vLLM allows.
# Besides these, every named parameter of the tokenizer's own apply_chat_template (`self` included:
# `reserved_template_kwargs`) is refused, so a key never collides with the call's own arguments.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "chat_template", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})
# The request fields a request's chat_template_kwargs may also set (vLLM: the kwargs win).
_OVERRIDABLE = ("add_generation_prompt", "continue_final_message", "tools", "documents")


_NAMED_PARAMETERS: dict[type, frozenset[str]] = {}  # by tokenizer class (a handful per process)


def _named_parameters(tokenizer_type: type) -> frozenset[str]:
    """The named parameters of `tokenizer_type.apply_chat_template` (`self` among them; not **kwargs)."""
    known = _NAMED_PARAMETERS.get(tokenizer_type)
    if known is not None:
        return known
    method = getattr(tokenizer_type, "apply_chat_template", None)
    try:
        parameters = list(inspect.signature(method).parameters.values()) if callable(method) else []
    except (TypeError, ValueError):  # a C function without a signature: the static list alone
        parameters = []
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    found = _NAMED_PARAMETERS[tokenizer_type] = frozenset(p.name for p in parameters if p.kind in named)
    return found


def reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    """The chat_template_kwargs keys a request may not set with this tokenizer: RESERVED_TEMPLATE_KWARGS and
    the named parameters of its apply_chat_template, but those a request may override (_OVERRIDABLE)."""
    return (RESERVED_TEMPLATE_KWARGS | _named_parameters(type(tokenizer))) - frozenset(_OVERRIDABLE)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None, *,
                add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None, content_format: str = "auto",
                image_placeholder: str | None = None) -> str:
    """The prompt text for a conversation, through the tokenizer's chat template or `chat_template`.

    `messages` are taken as clients send them (null content beside tool calls, content parts, tool
    messages) and given to the template in the shape it reads (chat_messages.py; `content_format`:
    "auto", "string" or "openai", vLLM's --chat-template-content-format).

    `add_generation_prompt` (default: True, or False with `continue_final_message`) ends the text with
    the header of a new assistant message; `continue_final_message` leaves the last message open
    instead, for the model to continue it (vLLM's and transformers' field of that name).
    `template_kwargs` (a request's `chat_template_kwargs`) reach the template as variables; they may
    also set the four arguments above, as in vLLM, but not the ones the engine sets (RESERVED_TEMPLATE_KWARGS).
    `image_placeholder`: a multimodal model's text for an image (its `{"type": "image"}` parts; chat_messages.py).
    Anything wrong with the request, the template failing on it included, is a RequestError naming the field."""
    if tokenizer is None:
        raise RequestError("chat needs a tokenizer, but the engine runs with skip_tokenizer_init", field="messages")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise RequestError(
            "the model's tokenizer has no chat template: pass chat_template (a Jinja template or a file)",
            field="messages",
        )
    _check_messages(messages)
    variables = dict(template_kwargs or {})
    reserved = sorted(reserved_template_kwargs(tokenizer) & variables.keys())
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: "
            f"{'it is an argument' if len(reserved) == 1 else 'they are arguments'} of the chat rendering call "
            "itself, which the server sets, not a template variable: rename the template variable (send messages in "
            "'messages', and start the server with --chat-template to change the template)",
            field=f"chat_template_kwargs.{reserved[0]}",
        )
    overrides = {name: variables.pop(name) for name in _OVERRIDABLE if name in variables}
    add_generation_prompt = overrides.get("add_generation_prompt", add_generation_prompt)
    continue_final_message = overrides.get("continue_final_message", continue_final_message)
    tools = overrides.get("tools", tools)
    documents = overrides.get("documents", documents)
    field_of = {name: f"chat_template_kwargs.{name}" if name in overrides else name for name in _OVERRIDABLE}
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{field_of[name]} must be true or false, got {_short(value)}", field=field_of[name])
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise RequestError(f"{field_of[name]} must be a list of objects, got {_short(value)}", field=field_of[name])
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true: continue_final_message "
                "continues the last message, add_generation_prompt starts a new one",
                field=field_of["continue_final_message"],
            )
        if messages[-1].get("role") != "assistant":
            raise RequestError(
                "continue_final_message continues the last message, which must be the assistant's; the last message "
                f"has role {messages[-1].get('role')!r}", field=field_of["continue_final_message"],
            )
    elif add_generation_prompt is None:
        add_generation_prompt = True
    conversation = conversation_for_template(messages, template, content_format, image_placeholder=image_placeholder)
    return _apply_template(tokenizer, conversation, template, variables, add_generation_prompt=bool(add_generation_prompt),
                           continue_final_message=continue_final_message, tools=tools, documents=documents)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} objects", field="messages")
    if not messages:
        raise RequestError("messages is empty: send at least one message", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] has no 'role' string", field=f"messages[{index}].role")


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], template: str, variables: dict[str, Any], *,
                    add_generation_prompt: bool, continue_final_message: bool, tools: Any, documents: Any) -> str:
    from jinja2 import TemplateError

    extra: dict[str, Any] = {}
    if tools is not None:
        extra["tools"] = tools
    if continue_final_message:  # only when set: a tokenizer plugin's apply_chat_template may not know it
        extra["continue_final_message"] = True
    if documents is not None:
        extra["documents"] = documents
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **extra, **variables,
        )
    except (TemplateError, ValueError, TypeError, LookupError, ArithmeticError) as exc:
        # What a template raises on the data it renders (its own raise_exception, a missing or
        # ill-typed value, transformers' checks of the conversation): this request's fault, or the
        # template's, never the server's. A different exception is a bug and stays a 500.
        raise RequestError(f"the chat template failed on this request: {exc}", field="messages") from exc
    except RecursionError as exc:  # data nested hundreds deep (in tool calls, say): the request's, not a bug
        raise RequestError("the conversation nests lists or objects too deeply for the chat template: flatten it",
                           field="messages") from exc


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
