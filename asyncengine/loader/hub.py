"""Model names as users write them: `ORG/NAME` (and `ORG/NAME:QUANT`, `ORG/NAME/FILE.gguf`) through the Hugging
Face hub's cache and downloads, as vLLM resolves them (docs/configuration.md, "Where the model comes from").

- `ORG/NAME`: `huggingface_hub.snapshot_download` of the files the engine reads (config, safetensors weights,
  tokenizer and generation files; never `*.bin`, `*.pt`, `*.gguf` and the like) at `revision`, into the hub
  cache: `download_dir` when given, else `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
- `ORG/NAME:QUANT` (vLLM's form for GGUF repositories, QUANT a GGUF type such as Q4_K_M) and
  `ORG/NAME/FILE.gguf`: the one `.gguf` file of the repository whose name carries QUANT (or the named file),
  downloaded alone with `hf_hub_download`, then converted like any GGUF file.
- `HF_HUB_OFFLINE=1` (read at each call, not only when huggingface_hub was imported): only the cache is read;
  a model there just works, one that is not is one `ModelLoadError` naming the model, the revision and the cache
  searched. `HF_ENDPOINT` names the hub (a mirror, or the tests' local stand-in); `HF_TOKEN` is huggingface_hub's.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from asyncengine.errors import ModelLoadError

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
REPO_ID = re.compile(rf"{_PART}/{_PART}")
_QUANT_FORM = re.compile(rf"(?P<repo>{_PART}/{_PART}):(?P<quant>[A-Za-z0-9_+-]+)")
_FILE_FORM = re.compile(rf"(?P<repo>{_PART}/{_PART})/(?P<file>[^:]+\.gguf)")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# What the engine reads from a repository: HF config and weights, tokenizer, generation defaults, chat templates.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
CONFIG_FILES = ["*.json"]
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubSettings:
    cache_dir: Path
    offline: bool
    endpoint: str | None

    @classmethod
    def from_environment(cls, download_dir: str | None) -> HubSettings:
        from huggingface_hub import constants

        if download_dir:
            cache = Path(download_dir).expanduser()
        elif os.environ.get("HF_HUB_CACHE"):
            cache = Path(os.environ["HF_HUB_CACHE"]).expanduser()
        elif os.environ.get("HF_HOME"):
            cache = Path(os.environ["HF_HOME"]).expanduser() / "hub"
        else:
            cache = Path(constants.HF_HUB_CACHE)
        flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
        offline = any(flag.strip().lower() in _TRUE for flag in flags) or bool(constants.HF_HUB_OFFLINE)
        return cls(cache, offline, os.environ.get("HF_ENDPOINT") or None)

    def describe(self) -> str:
        where = f"the Hugging Face cache {self.cache_dir}"
        return where + (" (HF_HUB_OFFLINE is set: nothing is downloaded)" if self.offline else "")


def is_hub_name(model: str) -> bool:
    """`model` names a hub repository (in one of the three forms) rather than a local path."""
    return bool(REPO_ID.fullmatch(model) or _QUANT_FORM.fullmatch(model) or _FILE_FORM.fullmatch(model))


def gguf_reference(model: str) -> tuple[str, str | None, str | None] | None:
    """(repo, quant, file) for `ORG/NAME:QUANT` or `ORG/NAME/FILE.gguf`, None for any other name."""
    quant = _QUANT_FORM.fullmatch(model)
    if quant:
        return quant["repo"], quant["quant"], None
    named = _FILE_FORM.fullmatch(model)
    if named and not any(part in ("", ".", "..") for part in named["file"].split("/")):
        return named["repo"], None, named["file"]
    return None


def snapshot(repo_id: str, revision: str | None, settings: HubSettings, patterns: list[str],
             *, what: str = "model") -> Path:
    """The cached snapshot folder of `repo_id` at `revision` holding the files matching `patterns`,
    downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, revision, settings, what):
        folder = snapshot_download(repo_id, revision=revision, cache_dir=str(settings.cache_dir),
                                   allow_patterns=patterns, local_files_only=settings.offline,
                                   endpoint=settings.endpoint)
    return Path(folder)


def gguf_file(repo_id: str, quant: str | None, filename: str | None, revision: str | None,
              settings: HubSettings) -> Path:
    """The `.gguf` file of `repo_id` that `quant` (a type such as Q4_K_M) or `filename` names, from the cache
    or downloaded alone."""
    from huggingface_hub import hf_hub_download

    if filename is None:
        files = _repository_files(repo_id, revision, settings)
        filename = _choose_gguf(repo_id, quant or "", [f for f in files if f.endswith(".gguf")])
    with _hub_errors(repo_id, revision, settings, f"GGUF file {filename}"):
        path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=str(settings.cache_dir),
                               local_files_only=settings.offline, endpoint=settings.endpoint)
    return Path(path)


def _choose_gguf(repo_id: str, quant: str, files: list[str]) -> str:
    """The one file whose name carries `quant` as a whole word (`-Q4_K_M.gguf`, `.q4_k_m.gguf`, ...)."""
    word = re.compile(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", re.IGNORECASE)
    matching = [f for f in files if word.search(Path(f).name[: -len(".gguf")]) and "mmproj" not in f.lower()]
    whole = [f for f in matching if not _SPLIT_GGUF.search(f)]
    if len(whole) == 1:
        return whole[0]
    if not matching:
        raise ModelLoadError(f"{repo_id} has no .gguf file named for {quant!r}; its .gguf files: "
                             f"{', '.join(sorted(files)) or 'none'}. Name one as {repo_id}/FILE.gguf")
    if not whole:
        raise ModelLoadError(f"{repo_id}:{quant} is split over several files ({', '.join(sorted(matching))}); only "
                             "single-file GGUF models load: merge them with llama.cpp's gguf-split --merge")
    raise ModelLoadError(f"{repo_id}:{quant} matches {len(whole)} files ({', '.join(sorted(whole))}): name one "
                         f"as {repo_id}/FILE.gguf")


def _repository_files(repo_id: str, revision: str | None, settings: HubSettings) -> list[str]:
    """The repository's file names: from the hub, or offline from its cached snapshot."""
    if settings.offline:
        folder = _cached_snapshot(repo_id, revision, settings)
        return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink()]
    from huggingface_hub import HfApi

    with _hub_errors(repo_id, revision, settings, "model"):
        return list(HfApi(endpoint=settings.endpoint).list_repo_files(repo_id, revision=revision))


def _cached_snapshot(repo_id: str, revision: str | None, settings: HubSettings) -> Path:
    storage = settings.cache_dir / f"models--{repo_id.replace('/', '--')}"
    revision = revision or "main"
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = storage / "snapshots" / commit
    if not folder.is_dir():
        raise ModelLoadError(_absent(repo_id, revision, settings, "model"))
    return folder


def _absent(repo_id: str, revision: str | None, settings: HubSettings, what: str) -> str:
    return (f"{what} {repo_id!r} (revision {revision or 'main'!r}) is not in {settings.describe()}: download it "
            f"first (`hf download {repo_id}`) or unset HF_HUB_OFFLINE" if settings.offline else
            f"{what} {repo_id!r} (revision {revision or 'main'!r}) is not in {settings.describe()}")


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, settings: HubSettings, what: str) -> Iterator[None]:
    """huggingface_hub's errors as one ModelLoadError that names the model, the revision and the cache."""
    from huggingface_hub import errors

    try:
        yield
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, ValueError,
            OSError) as exc:
        hub = settings.endpoint or "the Hugging Face hub"
        base = _absent(repo_id, revision, settings, what)
        if settings.offline:
            message = base
        elif isinstance(exc, errors.RevisionNotFoundError):
            message = f"{what} {repo_id!r} has no revision {revision!r} on {hub}"
        elif isinstance(exc, (errors.RepositoryNotFoundError, errors.GatedRepoError)):
            message = (f"{what} {repo_id!r} is not a local path, and {hub} has no repository of that name (or it is "
                       f"private or gated: log in with `hf auth login` or set HF_TOKEN); searched "
                       f"{settings.describe()} first")
        elif isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
            message = f"{base}, and {hub} could not be reached ({exc})"
        elif isinstance(exc, errors.EntryNotFoundError):
            message = f"{repo_id!r} (revision {revision or 'main'!r}) on {hub} has no {what}"
        else:
            message = f"{base}; fetching it from {hub} failed: {type(exc).__name__}: {exc}"
        raise ModelLoadError(message) from exc
