"""Speculative decoding on W6 (issue 37): the n-gram proposer's acceptance offline, and the speed run.

    python bench/spec_decode.py                                   # offline acceptance: k 4, prompt lookup 2..5
    python bench/spec_decode.py --k 2 4 8 --lookup 5 5 --lookup 2 5
    python bench/spec_decode.py --speed                           # decode tok/s, n-gram off and on, k 4, 2..5
    python bench/spec_decode.py --speed --prompts 3 --k 4 --lookup 2 5

The speed run (`--speed`) sends W6's prompts one at a time (a single request in the engine, as WORKLOADS.md's
single-request row) to one engine without speculation and then to one with n-gram speculation (each `--k` and
`--lookup` window), streaming each, and prints per prompt type the decode rate (output tokens after the first,
over the time from the first token to the last), the speedup over the run without speculation, and the engine's
own acceptance counters (vLLM's spec_decode_* totals: drafts, draft tokens, accepted; the mean acceptance
length 1 + accepted / drafts). Greedy, float32 by default; each engine decodes one short warm-up request
first. A figure taken on a loaded machine (shared cores: check the load average printed) is a ratio between the
runs of one invocation only, never a rate to quote: measure quietly for the record.

The offline acceptance (the default mode) is an acceptance figure, not a speed figure. The default model
decodes W6's prompts (bench/workloads/w6.json, each sent
as one chat message, greedy, 256 tokens) with `LLM`, without speculation. Then speculative decoding is replayed
over each continuation as the engine will run it: after the prefill's token, each step asks the proposer for k
drafts from the request's history (prompt and output so far; all of a step's requests in one call), keeps the
drafts that match the greedy continuation (under greedy verification, exactly the tokens the target would
keep) and adds the target's own next token. Per prompt type it prints the drafts proposed and accepted, the
acceptance rate (accepted / proposed), the steps that had a draft, and the tokens per target forward
(output tokens after the first / decode steps): the most a step can gain, before verification's cost.
Record the machine and the load average (printed) with the figures.

    python bench/spec_decode.py --pair --k 4 --dtype bfloat16     # the Qwen2.5-Coder pair (bench/spec_pair.py)

`--pair`: one request on Qwen2.5-Coder-1.5B-Instruct alone and with Qwen2.5-Coder-0.5B-Instruct drafting (both
Q4_K_M GGUF, installed by bench/spec_models.py), in an in-process harness over the project's model code, and
llama-server plain and with `--model-draft` in the same run (bench/spec_pair.py says what is measured).

    python bench/spec_decode.py --acceptance --json /tmp/w6.json  # issue 37's acceptance 4, every row

`--acceptance`: every figure of issue 37's acceptance 4 in one run (bench/spec_acceptance.py says what runs):
the default model on W6 at 1, 4 and 32 requests without speculation, with n-gram (and `draft_model` given
`--smol-draft`), llama-server plain and in its lookup mode; then the Qwen pair through the engine (the 1.5B
alone, with n-gram, with the 0.5B drafting; `--pair-loads`) and llama-server plain, `--model-draft` and lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import anyio
import numpy as np

from asyncengine import LLM, AsyncEngine, EngineConfig, SamplingParams
from asyncengine.config.speculative import parse_speculative_config
from asyncengine.interfaces.spec_decode import ProposalBatch, ProposerContext, ProposerRegistry

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "w6.json"


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} CPUs"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def greedy_continuations(prompts: list[dict], max_tokens: int,
                         dtype: str) -> tuple[list[list[int]], list[list[int]], float]:
    """(prompt token ids, output token ids) of each prompt, decoded without speculation; and the seconds."""
    # W6's 12 requests hold about 10,000 tokens: 640 MiB of KV cache covers them in float32 (the CPU
    # default, 2 GiB, would be touched by the engine's profile run for nothing).
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=640 * 1024**2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        start = time.perf_counter()
        outputs = llm.chat([[{"role": "user", "content": p["prompt"]}] for p in prompts], params)
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    return [list(o.prompt_token_ids) for o in outputs], [list(o.outputs[0].token_ids) for o in outputs], seconds


def replay(method_config: dict, prompt_ids: list[list[int]], output_ids: list[list[int]]) -> list[dict]:
    """Greedy speculative decoding replayed over fixed continuations: per request, its counters."""
    config = parse_speculative_config(method_config)
    k = config.num_speculative_tokens
    width = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids))
    proposer = ProposerRegistry.proposer_class(config.method)(
        config, ProposerContext(vocab_size=0, max_model_len=width + k + 1, max_num_seqs=len(prompt_ids)))
    full = np.zeros((len(prompt_ids), width), dtype=np.int64)
    for row, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        full[row, :len(p) + len(o)] = p + o
    emitted = [min(1, len(o)) for o in output_ids]  # the prefill's token comes without speculation
    stats = [{"steps": 0, "drafted": 0, "accepted": 0, "steps_with_draft": 0, "tokens": len(o)} for o in output_ids]
    while True:
        active = [i for i, o in enumerate(output_ids) if emitted[i] < len(o)]
        if not active:
            return stats
        lengths = np.array([len(prompt_ids[i]) + emitted[i] for i in active], dtype=np.int64)
        drafts = proposer.propose(ProposalBatch(token_ids=full[active], num_tokens=lengths), k).as_lists()
        for i, draft in zip(active, drafts):
            remaining = output_ids[i][emitted[i]:]
            accepted = 0
            # Drafts past the continuation's end are never verified (the request stops there).
            while accepted < min(len(draft), len(remaining) - 1) and draft[accepted] == remaining[accepted]:
                accepted += 1
            counted = min(len(draft), len(remaining) - 1)
            s = stats[i]
            s["steps"] += 1
            s["drafted"] += counted
            s["accepted"] += accepted
            s["steps_with_draft"] += bool(counted)
            emitted[i] += accepted + 1


def summary(name: str, rows: list[dict]) -> str:
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    decoded = sum(max(r["tokens"] - 1, 0) for r in rows)
    rate = accepted / drafted if drafted else 0.0
    return (f"{name:<10} prompts {len(rows):>2}  drafted {drafted:>5}  accepted {accepted:>5}  acceptance {rate:6.1%}  "
            f"steps with a draft {sum(r['steps_with_draft'] for r in rows):>4}/{steps:<4}  "
            f"tokens per target forward {decoded / steps if steps else 0.0:.2f}")


SPEC_FIELDS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


async def decode_rates(speculative_config: dict | None, prompts: list[dict], max_tokens: int, dtype: str) -> list[dict]:
    """Each prompt alone in one engine: its output tokens, its decode seconds (first token to last), and the
    engine's speculative counters over it."""
    config = EngineConfig(dtype=dtype, kv_cache_memory_bytes=256 * 1024**2, max_model_len=2048,
                          speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = []
    async with AsyncEngine.start(config) as engine:
        async for _ in engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8)):
            pass  # the warm-up: first-call costs stay out of the figures
        for prompt in prompts:
            request = await engine.chat_prompt([{"role": "user", "content": prompt["prompt"]}])
            before = await engine.get_scheduler_stats()
            first = last = 0.0
            num_tokens = 0
            async for output in engine.generate(request, params):
                new = len(output.outputs[0].token_ids)
                if new and not num_tokens:
                    first = time.perf_counter()
                num_tokens += new
                last = time.perf_counter()
            after = await engine.get_scheduler_stats()
            rows.append({"type": prompt["type"], "tokens": num_tokens, "seconds": last - first,
                         **{name: getattr(after, name) - getattr(before, name) for name in SPEC_FIELDS}})
    return rows


def speed_summary(name: str, rows: list[dict], base: list[dict] | None) -> str:
    decoded = sum(max(r["tokens"] - 1, 0) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    rate = decoded / seconds if seconds else 0.0
    line = f"{name:<10} prompts {len(rows):>2}  tokens {sum(r['tokens'] for r in rows):>5}  decode {rate:7.1f} tok/s"
    if base is not None:
        base_seconds = sum(r["seconds"] for r in base)
        base_rate = sum(max(r["tokens"] - 1, 0) for r in base) / base_seconds if base_seconds else 0.0
        drafts, draft_tokens, accepted = (sum(r[f] for r in rows) for f in SPEC_FIELDS)
        line += (f"  x{rate / base_rate if base_rate else 0.0:.2f} over no speculation  drafts {drafts:>4}  "
                 f"draft tokens {draft_tokens:>5}  accepted {accepted:>5} "
                 f"({accepted / draft_tokens if draft_tokens else 0.0:6.1%})  "
                 f"mean acceptance length {1 + accepted / drafts if drafts else 1.0:.2f}")
    return line


def speed_run(args: argparse.Namespace, workload: dict, prompts: list[dict], windows: list[list[int]],
              commit: str) -> None:
    print(f"# W6 single-request decode, n-gram off and on; {machine()}; load {load_average()}; commit {commit}; "
          f"default model, {args.dtype}, greedy, {workload['max_tokens']} tokens; {len(prompts)} prompts, one at a "
          "time; under load a ratio between these runs only")
    runs: list[tuple[str, dict | None]] = [("no speculation", None)] + [
        (f"ngram k={k} prompt_lookup {low}..{high}",
         {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high})
        for low, high in windows for k in args.k]
    base: list[dict] | None = None
    for title, speculative in runs:
        rows = anyio.run(decode_rates, speculative, prompts, workload["max_tokens"], args.dtype)
        print(f"{title} (load {load_average()})")
        by_type: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_type[row["type"]].append(row)
        for name in ("edit", "summarise", "code"):
            if by_type[name]:
                print("  " + speed_summary(name, by_type[name],
                                           None if base is None else [b for b in base if b["type"] == name]))
        print("  " + speed_summary("all", rows, base))
        if base is None:
            base = rows


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens values")
    parser.add_argument("--lookup", type=int, nargs=2, action="append", metavar=("MIN", "MAX"),
                        help="prompt_lookup_min and max (repeatable; default 2 5)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--speed", action="store_true", help="the speed run: decode tok/s with and without n-gram")
    parser.add_argument("--prompts", type=int, default=None,
                        help="the speed run: the first N prompts of each type (default: all)")
    parser.add_argument("--pair", action="store_true",
                        help="the Qwen2.5-Coder 1.5B target with its 0.5B draft, and llama-server (bench/spec_pair.py)")
    parser.add_argument("--pair-tokens", type=int, default=128, help="--pair: tokens decoded")
    parser.add_argument("--pair-quantization", default="gguf", help="--pair: the models' quantization (none: "
                        "dequantized weights)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="--pair, --acceptance: threads of both engines")
    parser.add_argument("--pair-models", nargs=2, metavar=("TARGET", "DRAFT"),
                        help="--pair on other GGUF files (a smoke run on small models); default: the Qwen pair")
    parser.add_argument("--acceptance", action="store_true",
                        help="issue 37's acceptance 4: every row, both engines (bench/spec_acceptance.py)")
    parser.add_argument("--requests", type=int, nargs="*", default=[4, 32],
                        help="--acceptance: the batch sizes after the single-request rows")
    parser.add_argument("--pair-prompts", type=int, default=1, help="--acceptance: pair prompts of each type")
    parser.add_argument("--pair-k", type=int, default=4, help="--acceptance: the draft model's k")
    parser.add_argument("--pair-loads", nargs="+", default=["bfloat16", "gguf"], choices=["bfloat16", "gguf"],
                        help="--acceptance: how the pair is loaded (bfloat16: dequantized; gguf: blocks kept)")
    parser.add_argument("--pair-modes", nargs="+", default=["none", "lookup", "draft"],
                        choices=["none", "lookup", "draft"], help="--acceptance: the pair's rows, both engines")
    parser.add_argument("--engines", nargs="+", default=["asyncengine", "llama.cpp"],
                        choices=["asyncengine", "llama.cpp"], help="--acceptance: the engines measured")
    parser.add_argument("--smol-draft", default=None, help="--acceptance: a draft model for the default model")
    parser.add_argument("--smol-kv-bytes", type=int, default=1536 * 1024**2,
                        help="--acceptance: the default model's KV cache (32 requests of W6 in float32: 1.3 GB)")
    parser.add_argument("--skip-smol", action="store_true", help="--acceptance: the pair's rows only")
    parser.add_argument("--skip-pair", action="store_true", help="--acceptance: the default model's rows only")
    parser.add_argument("--max-tokens", type=int, default=None, help="--acceptance: instead of W6's 256 (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="--acceptance: write every row here")
    args = parser.parse_args(argv)
    if args.acceptance:
        from spec_acceptance import run

        header = {"machine": machine(), "load_start": load_average(), "commit": _commit(), "dtype": args.dtype,
                  "threads": args.threads, "max_tokens": args.max_tokens or json.loads(WORKLOAD.read_text())["max_tokens"],
                  "command": " ".join(sys.argv)}
        print(f"# issue 37 acceptance 4; {header['machine']}; load {header['load_start']}; commit {header['commit']};"
              f" {args.threads} threads", flush=True)
        if args.prompts is None:
            args.prompts = 2
        result = run(args, header)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
            print(f"# rows written to {args.json}")
        return
    if args.pair:
        from spec_pair import run_pair

        if args.pair_models:
            target, draft = (Path(p) for p in args.pair_models)
        else:
            import spec_models

            draft, target = spec_models.prepare()
        quantization = None if args.pair_quantization == "none" else args.pair_quantization
        commit = _commit()
        header = f"# speculative decoding, draft/target pair; {machine()}; load {load_average()}; commit {commit}"
        for k in args.k:
            run_pair(target, draft, k=k, max_tokens=args.pair_tokens, dtype=args.dtype, quantization=quantization,
                     threads=args.threads, header=header)
        return
    windows = args.lookup or [[2, 5]]
    workload = json.loads(WORKLOAD.read_text())
    prompts = workload["prompts"]
    commit = _commit()
    if args.speed:
        if args.prompts is not None:
            prompts = [p for name in ("edit", "summarise", "code")
                       for p in [q for q in prompts if q["type"] == name][:args.prompts]]
        speed_run(args, workload, prompts, windows, commit)
        return
    print(f"# W6 n-gram acceptance, offline (not a speed figure); {machine()}; load {load_average()}; commit {commit}; "
          f"default model, {args.dtype}, greedy, {workload['max_tokens']} tokens; {len(prompts)} prompts")
    prompt_ids, output_ids, seconds = greedy_continuations(prompts, workload["max_tokens"], args.dtype)
    print(f"# continuations: {sum(map(len, output_ids))} tokens in {seconds:.1f} s without speculation "
          f"(all prompts at once; not a rate to quote); load {load_average()}")
    for low, high in windows:
        for k in args.k:
            config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
                      "prompt_lookup_max": high}
            stats = replay(config, prompt_ids, output_ids)
            by_type: dict[str, list[dict]] = defaultdict(list)
            for prompt, row in zip(prompts, stats):
                by_type[prompt["type"]].append(row)
            print(f"ngram k={k} prompt_lookup {low}..{high}")
            for name in ("edit", "summarise", "code"):
                print("  " + summary(name, by_type[name]))
            print("  " + summary("all", stats))


if __name__ == "__main__":
    sys.exit(main())
