"""Structured outputs: constrained against unconstrained decoding in the same run (issue 16).

    python bench/structured.py                         # W3's prompts, float32, xgrammar; then guidance
    python bench/structured.py --backends xgrammar --num-seqs 8
    python bench/structured.py --validate-all          # the 50 seeded schemas, each backend: stop + valid
    python bench/structured.py --validate-all --schemas 17 33   # only those seeds
    python bench/structured.py --repeats 3             # alternate the runs 3 times, keep each one's best

W3's prompt draw (../shared/WORKLOADS.md: 32 prompts of random token ids, seed 0), `max_tokens` 256, no
`ignore_eos`, greedy. The unconstrained run and one constrained run per backend share one engine (after a
warm-up), with PERSON (8 fields, bounded strings and arrays) as the schema. Prints one summary line per
backend: both runs' output tokens and tok/s, their ratio, the grammar compilation time and the time
spent filling masks per step (the engine core's get_structured_output_stats). With --repeats N the
unconstrained and constrained runs alternate N times and each keeps its best tok/s, so that a machine
whose load changes during the bench does not favour whichever ran first. A third run, unconstrained at
the constrained lengths (each prompt decodes, with ignore_eos, as many tokens as its constrained output
had), gives the constraint's own cost: the plain run's outputs run to max_tokens while the constrained
ones stop early, so the first ratio also compares unequal work (the prefills weigh on fewer tokens). The `uptime` load average is
printed before and after: record it with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # throughput.py's W3 draw
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the seeded schemas (test data)

from throughput import WORKLOADS, draw_workload  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{2,12}@[a-z]{2,10}\\.(com|org)$"},
        "city": {"type": "string", "maxLength": 20},
        "role": {"enum": ["engineer", "designer", "manager", "student"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "city", "role", "active", "score", "tags"],
    "additionalProperties": False,
}


def run(llm, prompts, params) -> tuple[float, int, list]:
    # Each timed run pays its own prefills: the runs share the prompts, so a run after another would
    # otherwise find them in the prefix cache (the constrained run, second, skipped most of its prefill).
    llm._portal.call(llm.engine.call_engine_core, "reset_prefix_cache")
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), outputs


def stats(llm) -> dict:
    return llm._portal.call(llm.engine.call_engine_core, "get_structured_output_stats")


def load() -> str:
    return "load average " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def compare(args, llm) -> None:
    from asyncengine import SamplingParams, StructuredOutputsParams

    num_seqs, lo, hi, _, _ = WORKLOADS["w3"]
    prompts, _ = draw_workload(num_seqs, lo, hi, 32, 256)
    prompts = [{"prompt_token_ids": ids} for ids in prompts[: args.num_seqs]]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    run(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    for backend in args.backends:
        print(f"structured {backend}: start, {load()}", flush=True)
        constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=PERSON, backend=backend,
                                                                                whitespace_pattern=args.whitespace_pattern))
        best_plain = best_so = best_matched = 0.0
        before = stats(llm)
        for _ in range(args.repeats):
            plain_s, plain_tokens, _ = run(llm, prompts, plain)
            so_s, so_tokens, outputs = run(llm, prompts, constrained)
            # The same work without the grammar: each prompt decodes exactly as many tokens as its
            # constrained output had, so the ratio against this run is the constraint's own cost
            # (the plain run's outputs run to max_tokens, the constrained ones stop early).
            matched = [SamplingParams(temperature=0, max_tokens=max(1, len(o.outputs[0].token_ids)), ignore_eos=True)
                       for o in outputs]
            matched_s, matched_tokens, _ = run(llm, prompts, matched)
            best_plain, best_so = max(best_plain, plain_tokens / plain_s), max(best_so, so_tokens / so_s)
            best_matched = max(best_matched, matched_tokens / matched_s)
        after = stats(llm)
        finished = sum(o.outputs[0].finish_reason == "stop" for o in outputs)
        valid = sum(validation_error(o.outputs[0].text, PERSON) is None for o in outputs)
        for output in [o for o in outputs if o.outputs[0].finish_reason != "stop"][:3]:
            print(f"structured {backend}: not stopped: ...{output.outputs[0].text[-160:]!r}", flush=True)
        masks = after["num_masks"] - before["num_masks"]
        mask_s = after["mask_seconds"] - before["mask_seconds"]
        print(f"structured {backend}: {len(prompts)} W3 prompts, max_tokens {args.max_tokens}, best of "
              f"{args.repeats}: unconstrained {plain_tokens} tokens {best_plain:.1f} tok/s; constrained {so_tokens} "
              f"tokens {best_so:.1f} tok/s ({finished}/{len(prompts)} stopped, {valid} valid); "
              f"ratio {best_so / best_plain:.2f}; "
              f"unconstrained at the constrained lengths {matched_tokens} tokens {best_matched:.1f} tok/s, ratio "
              f"{best_so / best_matched:.2f}; "
              f"compile {after['compile_seconds'] - before['compile_seconds']:.3f} s; masks {masks} "
              f"({1e6 * mask_s / max(masks, 1):.0f} us per request-step); end, {load()}", flush=True)


def validation_error(text: str, schema: dict) -> str | None:
    """Why `text` is not a JSON document valid against `schema` (one line), or None when it is."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def validate_all(llm, backends, only: list[int] | None = None) -> None:
    from asyncengine import SamplingParams, StructuredOutputsParams
    from structured_output.schemas import SCHEMAS

    indices = only if only else list(range(len(SCHEMAS)))
    for backend in backends:
        schemas = [SCHEMAS[index] for index in indices]
        params = [SamplingParams(temperature=0, max_tokens=256,
                                 structured_outputs=StructuredOutputsParams(json=s, backend=backend)) for s in schemas]
        chats = [[{"role": "user", "content": f"Write one example JSON document for this schema: {json.dumps(s)}"}]
                 for s in schemas]
        outputs = llm.chat(chats, params, use_tqdm=False)
        good = 0
        for index, schema, output in zip(indices, schemas, outputs):
            completion = output.outputs[0]
            failure = validation_error(completion.text, schema)
            if failure is None and completion.finish_reason != "stop":
                failure = f"finish_reason {completion.finish_reason}"
            good += failure is None
            if failure is not None:  # which schema, why, and what the model wrote: enough to judge it
                print(f"structured {backend}: schema {index} failed ({failure}; {len(completion.token_ids)} "
                      f"tokens): {completion.text!r}\n  schema: {json.dumps(schema)}", flush=True)
        print(f"structured {backend}: {good}/{len(indices)} schemas stopped and validated; {load()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the default model)")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    parser.add_argument("--num-seqs", type=int, default=WORKLOADS["w3"][0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="alternate the two runs this many times (best kept)")
    # The default model, on W3's random-token prompts, fills every gap between JSON tokens with the
    # whitespace the grammar allows (12 newlines a gap by default): a 256-token output never closes the
    # document. A compact pattern (xgrammar: any pattern means compact JSON) lets the outputs finish.
    parser.add_argument("--whitespace-pattern", default=" ?",
                        help="the constrained run's whitespace_pattern ('' for the backends' default, 12 per gap)")
    parser.add_argument("--validate-all", action="store_true")
    parser.add_argument("--schemas", type=int, nargs="+", help="with --validate-all: only these seeds")
    args = parser.parse_args()
    args.whitespace_pattern = args.whitespace_pattern or None
    from asyncengine import LLM

    with LLM(args.model, dtype="float32") as llm:
        if args.validate_all:
            validate_all(llm, args.backends, args.schemas)
        else:
            compare(args, llm)


if __name__ == "__main__":
    main()
