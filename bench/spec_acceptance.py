"""`bench/spec_decode.py --acceptance`: every row of issue 37's acceptance 4 in one run, against llama.cpp.

What runs, in this order, one engine (or one llama-server) at a time, each freed before the next starts:

1. **The default model (SmolLM2-135M-Instruct) on W6**, in `--dtype` (float32 by default), greedy, W6's 256
   tokens at most, prefix caching off (the 4- and 32-request rows repeat prompts), `--threads` threads:
   asyncengine without speculation, with n-gram (k 4, prompt lookup 2..5) and, where the engine runs it, with
   `draft_model` (`--smol-draft`: a draft for the default model; none is given by default, as no smaller model
   of its vocabulary is at hand); then llama-server on the GGUF file of the same weights at the same precision
   (F32 for float32, BF16 for bfloat16; bench/llama_server.py makes them), plain and in its lookup mode
   (`--spec-type ngram-simple`, see LLAMA_LOOKUP). Each runs:
   - **1 request**: `--prompts` prompts of each type (edit, summarise, code), one at a time; the decode rate is
     output tokens after the first over the time from the first token to the last (llama-server: its own
     `predicted_per_second`, which times the same span);
   - **4 and 32 requests**: W6's prompts (types interleaved, cycled to the count), all sent at once; the rate is
     all output tokens over the wall time from the first request sent to the last token (prefill included).
2. **The Qwen2.5-Coder pair** (bench/spec_models.py installs both Q4_K_M files): one request at a time,
   `--pair-prompts` prompts of each type, `--pair-tokens` tokens: the 1.5B alone, with n-gram, and with the 0.5B
   drafting (`draft_model`, k `--pair-k`), for each of `--pair-loads` (`bfloat16`: the file's weights
   dequantized to bfloat16; `gguf`: its blocks kept, `quantization="gguf"`, bfloat16 activations); then
   llama-server on the same files: plain, `--model-draft` (`--spec-type draft-simple`, the same k) and lookup.

Outputs are greedy everywhere; asyncengine's greedy output with speculation is token-identical to its output
without (the suite's tests check that), and this run prints, per row, whether its outputs equal the row without
speculation of the same engine. Every row is printed as it finishes, with the load average, and all rows go to
`--json`. A figure taken on a loaded machine is a ratio between rows of one run, not a rate to quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "w6.json"
TYPES = ("edit", "summarise", "code")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
# llama.cpp's prompt lookup in llama-server: ngram-simple searches the history (prompt and output) for the last
# n tokens and drafts the m after its latest earlier occurrence. n 3 and m 4 are the nearest to our n-gram row
# (k 4, suffixes of 5 down to 2 tokens; it takes one fixed n, and drafts only when m >= n).
LLAMA_LOOKUP = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def select_prompts(per_type: int) -> list[dict]:
    """The first `per_type` prompts of each type, in TYPES order."""
    prompts = json.loads(WORKLOAD.read_text())["prompts"]
    return [p for name in TYPES for p in [q for q in prompts if q["type"] == name][:per_type]]


def interleaved(count: int) -> list[dict]:
    """`count` of W6's prompts, the types taking turns (edit, summarise, code, edit, ...), cycled."""
    prompts = json.loads(WORKLOAD.read_text())["prompts"]
    by_type = [[q for q in prompts if q["type"] == name] for name in TYPES]
    order = [group[i] for i in range(max(map(len, by_type))) for group in by_type if i < len(group)]
    return [order[i % len(order)] for i in range(count)]


def rate_row(engine: str, model: str, mode: str, requests: int, rows: list[dict], *, single: bool) -> dict:
    """One figure from per-request results: `single` sums decode spans; otherwise `rows[0]` holds the batch's
    wall time."""
    tokens = sum(r["tokens"] for r in rows)
    if single:
        decoded = sum(max(r["tokens"] - 1, 0) for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        rate = decoded / seconds if seconds else 0.0
    else:
        seconds = rows[0]["wall"]
        rate = tokens / seconds if seconds else 0.0
    drafted = sum(r.get("draft_tokens", 0) for r in rows)
    accepted = sum(r.get("accepted", 0) for r in rows)
    row = {"engine": engine, "model": model, "mode": mode, "requests": requests, "prompts": len(rows),
           "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(rate, 2),
           "rate": "decode" if single else "output, wall", "draft_tokens": drafted, "accepted": accepted,
           "acceptance": round(accepted / drafted, 4) if drafted else None, "load": load_average()}
    if single:
        row["per_type"] = {}
        for name in TYPES:
            mine = [r for r in rows if r.get("type") == name]
            spans = sum(r["seconds"] for r in mine)
            if mine and spans:
                row["per_type"][name] = round(sum(max(r["tokens"] - 1, 0) for r in mine) / spans, 2)
    return row


# --- asyncengine ------------------------------------------------------------------------------------------------

SPEC_FIELDS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


async def _one(engine: Any, prompt: dict, params: Any, ids: list[int]) -> dict:
    first = last = 0.0
    tokens: list[int] = []
    async for output in engine.generate({"prompt_token_ids": ids}, params):
        new = output.outputs[0].token_ids
        if new and not tokens:
            first = time.perf_counter()
        tokens += list(new)
        last = time.perf_counter()
    return {"type": prompt["type"], "tokens": len(tokens), "seconds": last - first, "output": tokens}


async def engine_rows(engine_options: dict, model: str, mode: str, singles: list[dict], counts: list[int],
                      max_tokens: int, report: Callable[[dict], None],
                      plain_outputs: list[list[int]] | None = None) -> dict[str, Any]:
    """asyncengine's rows for one configuration, each reported as it is measured: returns {"rows": [...],
    "ids": {prompt text: ids}, "outputs": [...]} (the single-request outputs, in `singles` order);
    `plain_outputs`: the same prompts' outputs without speculation, to compare with."""
    from asyncengine import AsyncEngine, EngineConfig, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out: dict[str, Any] = {"rows": [], "ids": {}, "outputs": []}
    start = time.perf_counter()
    async with AsyncEngine.start(EngineConfig(**engine_options)) as engine:
        loaded = time.perf_counter() - start
        async for _ in engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8)):
            pass  # the warm-up: first-call costs stay out of the figures

        async def ids_of(prompt: dict) -> list[int]:
            key = prompt["prompt"]
            if key not in out["ids"]:
                chat = await engine.chat_prompt([{"role": "user", "content": prompt["prompt"]}])
                out["ids"][key] = list(chat["prompt_token_ids"])
            return out["ids"][key]

        results = []
        before = await engine.get_scheduler_stats()
        for prompt in singles:
            mark = await engine.get_scheduler_stats()
            result = await _one(engine, prompt, params, await ids_of(prompt))
            after = await engine.get_scheduler_stats()
            result.update({"draft_tokens": after.spec_decode_num_draft_tokens - mark.spec_decode_num_draft_tokens,
                           "accepted": after.spec_decode_num_accepted_tokens - mark.spec_decode_num_accepted_tokens})
            results.append(result)
        del before
        if singles:
            row = rate_row("asyncengine", model, mode, 1, results, single=True)
            row["load_seconds"] = round(loaded, 1)
            out["rows"].append(row)
            out["outputs"] = [r["output"] for r in results]
            if plain_outputs is not None:
                row["outputs_equal"] = out["outputs"] == plain_outputs
            report(row)
        for count in counts:
            batch = interleaved(count)
            ids = [await ids_of(p) for p in batch]
            mark = await engine.get_scheduler_stats()
            results = [{} for _ in batch]
            began = time.perf_counter()

            async def run(i: int) -> None:
                results[i] = await _one(engine, batch[i], params, ids[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(batch)):
                    tg.start_soon(run, i)
            wall = time.perf_counter() - began
            after = await engine.get_scheduler_stats()
            results[0]["wall"] = wall
            results[0]["draft_tokens"] = after.spec_decode_num_draft_tokens - mark.spec_decode_num_draft_tokens
            results[0]["accepted"] = after.spec_decode_num_accepted_tokens - mark.spec_decode_num_accepted_tokens
            row = rate_row("asyncengine", model, mode, count, results, single=False)
            out["rows"].append(row)
            report(row)
    return out


# --- llama.cpp --------------------------------------------------------------------------------------------------

def llama_rows(model_file: Path, extra: list[str], model: str, mode: str, singles: list[list[int]],
               single_types: list[str], batches: dict[int, list[list[int]]], max_tokens: int, threads: int,
               report: Callable[[dict], None]) -> list[dict]:
    """llama-server's rows for one mode: one server, as many slots as the largest batch, a unified KV cache."""
    import llama_server

    slots = max([1, *batches])
    longest = max(len(p) for p in [*singles, *(p for b in batches.values() for p in b)])
    port = llama_server._free_port()
    command = [str(llama_server.find_binary("llama-server")), "-m", str(model_file), "--host", "127.0.0.1",
               "--port", str(port), "-np", str(slots), "-c", str(slots * (longest + max_tokens + 16)), "-cb",
               "-kvu", "-t", str(threads), "-tb", str(threads), "--no-webui", "-cram", "0", *extra]
    rows = []

    def body(ids: list[int]) -> dict:
        return {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                "samplers": ["top_k"], "top_k": 1}

    with llama_server.serving(command, port):
        llama_server._post(port, dict(body(singles[0] if singles else [1, 2, 3]), n_predict=8), timeout=600)
        if singles:
            results = []
            for ids, kind in zip(singles, single_types):
                answer = llama_server._post(port, body(ids), timeout=3600)
                timings = answer.get("timings", {})
                n = int(answer.get("tokens_predicted", 0))
                rate = timings.get("predicted_per_second") or 0.0
                results.append({"type": kind, "tokens": n, "seconds": (n - 1) / rate if rate else 0.0,
                                "draft_tokens": timings.get("draft_n") or 0,
                                "accepted": timings.get("draft_n_accepted") or 0})
            row = rate_row("llama.cpp", model, mode, 1, results, single=True)
            rows.append(row)
            report(row)
        for count, batch in batches.items():
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                answers = list(pool.map(lambda ids: llama_server._post(port, body(ids), timeout=3600), batch))
            wall = time.perf_counter() - began
            results = [{"tokens": int(a.get("tokens_predicted", 0)),
                        "draft_tokens": a.get("timings", {}).get("draft_n") or 0,
                        "accepted": a.get("timings", {}).get("draft_n_accepted") or 0} for a in answers]
            results[0]["wall"] = wall
            row = rate_row("llama.cpp", model, mode, count, results, single=False)
            rows.append(row)
            report(row)
    return rows


# --- the run ----------------------------------------------------------------------------------------------------

def show(row: dict) -> None:
    acceptance = "" if row["acceptance"] is None else (
        f"  accepted {row['accepted']}/{row['draft_tokens']} ({row['acceptance']:.1%})")
    per_type = "".join(f"  {k} {v:.1f}" for k, v in row.get("per_type", {}).items())
    same = "" if "outputs_equal" not in row else f"  outputs = no speculation: {row['outputs_equal']}"
    print(f"{row['engine']:<11} {row['model']:<16} {row['mode']:<26} {row['requests']:>2} req  "
          f"{row['tok_s']:8.2f} tok/s ({row['rate']}; {row['tokens']} tokens, {row['seconds']:.1f} s)"
          f"{per_type}{acceptance}{same}  load {row['load']}", flush=True)


def printer(rows: list[dict]) -> Callable[[dict], None]:
    def report(row: dict) -> None:
        rows.append(row)
        show(row)
    return report


def _engine_section(options: dict, model: str, runs: list[tuple[str, dict | None]], singles: list[dict],
                    counts: list[int], max_tokens: int, rows: list[dict]) -> dict[str, list[int]]:
    """asyncengine without and with each proposer, each configuration in a process of its own (`child`), so
    that its models are freed before the next starts (an in-process engine's close left the 1.5B's weights
    behind: the draft row's process held 10.5 GB): the prompts' ids."""
    ids: dict[str, list[int]] = {}
    plain_outputs: list[list[int]] | None = None
    for mode, speculative in runs:
        with tempfile.TemporaryDirectory(prefix="spec-acceptance-") as folder:
            task, answer = Path(folder) / "task.json", Path(folder) / "result.json"
            task.write_text(json.dumps({
                "options": dict(options, speculative_config=speculative), "model": model, "mode": mode,
                "singles": singles, "counts": counts, "max_tokens": max_tokens,
                "plain_outputs": None if speculative is None else plain_outputs}))
            done = subprocess.run([sys.executable, __file__, str(task), str(answer)])
            if done.returncode != 0 or not answer.exists():
                print(f"asyncengine {model} {mode}: not run (its process ended with {done.returncode}; its "
                      "output above says why)", flush=True)
                continue
            result = json.loads(answer.read_text())
        rows += result["rows"]  # the child printed them
        ids.update(result["ids"])
        if speculative is None:
            plain_outputs = result["outputs"]
    return ids


def child(task_path: Path, answer_path: Path) -> int:
    """One configuration's rows (a process of its own): prints each row, writes the result for the parent. A
    proposer the engine cannot run ends it with the StartupError's message, and the parent goes on."""
    from asyncengine.errors import StartupError

    task = json.loads(task_path.read_text())
    try:
        result = anyio.run(engine_rows, task["options"], task["model"], task["mode"], task["singles"], task["counts"],
                           task["max_tokens"], show, task["plain_outputs"])
    except StartupError as error:
        print(f"asyncengine {task['model']} {task['mode']}: cannot start ({type(error).__name__}: {error})",
              flush=True)
        return 3
    answer_path.write_text(json.dumps(result))
    return 0


def _llama_section(model_file: Path, model: str, modes: list[tuple[str, list[str]]], singles: list[dict],
                   counts: list[int], ids: dict[str, list[int]], max_tokens: int, threads: int,
                   report: Callable[[dict], None]) -> None:
    import llama_server

    single_ids = [ids[p["prompt"]] for p in singles]
    batches = {count: [ids[p["prompt"]] for p in interleaved(count)] for count in counts}
    for mode, extra in modes:
        try:
            llama_rows(model_file, extra, model, mode, single_ids, [p["type"] for p in singles], batches,
                       max_tokens, threads, report)
        except (llama_server.Unavailable, OSError) as error:  # not built, or it failed: said, ours stand
            print(f"llama.cpp {model} {mode}: not run ({type(error).__name__}: {error})", flush=True)


def ratios(rows: list[dict]) -> dict[str, float]:
    """Each speculative row over the same engine's, model's and request count's row without speculation."""
    plain = {(r["engine"], r["model"], r["requests"]): r["tok_s"] for r in rows if r["mode"].startswith("none")}
    out = {}
    for r in rows:
        base = plain.get((r["engine"], r["model"], r["requests"]))
        if not r["mode"].startswith("none") and base:
            out[f"{r['engine']} {r['model']} {r['mode']} {r['requests']} req"] = round(r["tok_s"] / base, 3)
    return out


def chat_ids(gguf_path: Path | None, prompts: list[dict]) -> dict[str, list[int]]:
    """The prompts through the chat template of the model in `gguf_path` (None: the default model's file)."""
    from transformers import AutoTokenizer

    from asyncengine.loader.gguf import convert_gguf_to_hf_dir
    from asyncengine.loader.packaged_models import default_model_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf_to_hf_dir(gguf_path or default_model_gguf_path(),
                                                                     progress=False))
    return {p["prompt"]: list(tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)) for p in prompts}


def _kind(mode: str) -> str:
    return "none" if mode.startswith("none") else "lookup" if ("ngram" in mode or "lookup" in mode) else "draft"


def against_llama(rows: list[dict]) -> dict[str, float]:
    """Each asyncengine row over llama.cpp's row of the corresponding mode (none, lookup, draft model), same
    model family and request count."""
    llama = {(_kind(r["mode"]), r["model"].split()[0], r["requests"]): r["tok_s"] for r in rows
             if r["engine"] == "llama.cpp"}
    out = {}
    for r in rows:
        peer = llama.get((_kind(r["mode"]), r["model"].split()[0], r["requests"]))
        if r["engine"] == "asyncengine" and peer:
            out[f"{r['model']} {r['mode']} {r['requests']} req"] = round(r["tok_s"] / peer, 3)
    return out


def run(args: Any, header: dict) -> dict:
    """All the rows; returns what --json writes."""
    import llama_server

    rows: list[dict] = []
    report = printer(rows)
    threads = args.threads
    if not args.skip_smol:
        singles = select_prompts(args.prompts)
        options = {"dtype": args.dtype, "max_model_len": 2048, "kv_cache_memory_bytes": args.smol_kv_bytes,
                   "enable_prefix_caching": False, "cpu_threads": threads, "max_num_seqs": max([1, *args.requests])}
        runs: list[tuple[str, dict | None]] = [("none", None), ("ngram k4 lookup 2..5", NGRAM)]
        if args.smol_draft:
            runs.append((f"draft_model k{args.pair_k}", {"method": "draft_model", "model": args.smol_draft,
                                                         "num_speculative_tokens": args.pair_k}))
        print(f"# SmolLM2-135M-Instruct, {args.dtype}, W6, {len(singles)} single prompts, "
              f"{args.requests} requests at once; load {load_average()}", flush=True)
        ids = (_engine_section(options, "SmolLM2-135M", runs, singles, args.requests, header["max_tokens"], rows)
               if "asyncengine" in args.engines else chat_ids(None, singles + interleaved(max([0, *args.requests]))))
        gguf_type = llama_server.GGUF_TYPES[args.dtype]
        if "llama.cpp" in args.engines:
            _llama_section(llama_server.gguf_file(gguf_type), "SmolLM2-135M",
                           [(f"none ({gguf_type} GGUF)", []), ("lookup ngram-simple n3 m4", LLAMA_LOOKUP)],
                           singles, args.requests, ids, header["max_tokens"], threads, report)
    if not args.skip_pair:
        import spec_models

        draft, target = spec_models.prepare()
        singles = select_prompts(args.pair_prompts)
        speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.pair_k}
        ids = {}
        for load in args.pair_loads if "asyncengine" in args.engines else []:
            options = {"model": str(target), "dtype": "bfloat16", "quantization": "gguf" if load == "gguf" else None,
                       "max_model_len": 2048, "kv_cache_memory_bytes": 256 * 1024**2, "enable_prefix_caching": False,
                       "cpu_threads": threads, "max_num_seqs": 1}  # one request: the draft's own cache is sized
            # for max_num_seqs requests of max_model_len tokens (the default 256 would take 6 GB for the 0.5B)
            name = f"Qwen-1.5B {load}"
            print(f"# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, loaded as {load}, {len(singles)} prompts one at a time, "
                  f"{args.pair_tokens} tokens; load {load_average()}", flush=True)
            # The draft loaded as the target: a .gguf draft's blocks kept too with quantization gguf (the key is
            # speculative_config's), else dequantized to the target's dtype.
            draft_config = dict(speculative, quantization="gguf") if load == "gguf" else speculative
            runs = [run for run in [("none", None), ("ngram k4 lookup 2..5", NGRAM),
                                    (f"draft_model 0.5B k{args.pair_k}", draft_config)]
                    if _kind(run[0]) in args.pair_modes]
            ids.update(_engine_section(options, name, runs, singles, [], args.pair_tokens, rows))
        if not ids:  # our engine not run: the chat template's ids from the converted model's tokenizer
            ids = chat_ids(target, singles)
        if "llama.cpp" in args.engines:
            draft_args = ["--model-draft", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max",
                          str(args.pair_k), "--spec-draft-n-min", "0", "-td", str(threads)]
            modes = [("none", []), (f"draft-simple 0.5B k{args.pair_k}", draft_args),
                     ("lookup ngram-simple n3 m4", LLAMA_LOOKUP)]
            _llama_section(target, "Qwen-1.5B Q4_K_M", [m for m in modes if _kind(m[0]) in args.pair_modes], singles,
                           [], ids, args.pair_tokens, threads, report)
    result = dict(header, load_end=load_average(), rows=rows, ratios=ratios(rows), against_llama=against_llama(rows))
    print("# speedup over the same engine without speculation (same model, same request count):")
    for name, value in result["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    print("# asyncengine over llama.cpp's corresponding mode (none / lookup / draft model):")
    for name, value in result["against_llama"].items():
        print(f"  {name}: {value:.2f}x")
    print(f"# load average at the end {result['load_end']}")
    return result


if __name__ == "__main__":  # the child of _engine_section: TASK.json RESULT.json
    raise SystemExit(child(Path(sys.argv[1]), Path(sys.argv[2])))
