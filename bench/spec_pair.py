"""`bench/spec_decode.py --pair`: one request, greedy, Qwen2.5-Coder-1.5B-Instruct alone and with
Qwen2.5-Coder-0.5B-Instruct drafting (bench/spec_models.py installs both), then llama.cpp's llama-server on
the same GGUF files, plain and with `--model-draft`, in the same run.

Our side runs in this process, on the project's model code, loader and attention, not through the engine's
step: the engine's speculative integration (scheduler, verification forward in the model runner) is built
separately. Both of our modes use the same harness, so their ratio is the draft's effect on this code:
- alone: the target decodes one token per forward on its own paged KV cache (`ProposerKVCache`);
- with the draft: the `draft_model` proposer drafts k tokens, the target scores the last token and the k
  drafts in one forward, the longest prefix equal to the target's argmax is kept plus the target's token
  (greedy verification, rejection_sampler.py's rule), and the target's cache drops what was rejected.
The outputs of both modes are compared token by token (printed: where they first differ, if they do).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "w6.json"
BLOCK = 16


class GreedyTarget:
    """The target on a KV cache of its own: `forward(keep, tokens, start)` computes `tokens` at positions
    `start...` after the first `keep` cached entries and returns the argmax after each."""

    def __init__(self, model_config, quantization: str | None, max_len: int) -> None:
        from asyncengine.loader.model_loader import load_model
        from asyncengine.platforms.cpu import CpuPlatform
        from asyncengine.worker.spec_decode.proposer_cache import ProposerKVCache, blocks_for

        self.model = load_model(model_config, device=torch.device("cpu"), quantization=quantization)
        self.cache = ProposerKVCache(self.model, num_blocks=blocks_for(1, max_len, 0, BLOCK), block_size=BLOCK,
                                     dtype=getattr(torch, model_config.dtype), device=torch.device("cpu"),
                                     platform=CpuPlatform, name="target")

    @torch.inference_mode()
    def forward(self, keep: int, tokens: list[int], start: int) -> list[int]:
        from asyncengine.worker.spec_decode.proposer_cache import Chunk

        chunk = Chunk("r", keep, tokens, list(range(start, start + len(tokens))))
        _, positions, _, metadata = self.cache.prepare([chunk])
        hidden = self.model(torch.tensor(tokens), positions, metadata)
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


def decode_alone(target: GreedyTarget, prompt: list[int], n: int) -> tuple[list[int], float]:
    """(tokens, seconds of the decode after the prefill's token)."""
    target.cache.remove(["r"])
    out = [target.forward(0, prompt, 0)[-1]]
    start = time.perf_counter()
    while len(out) < n:
        position = len(prompt) + len(out) - 1
        out.append(target.forward(position, [out[-1]], position)[-1])
    return out, time.perf_counter() - start


def decode_speculative(target: GreedyTarget, proposer, prompt: list[int], n: int,
                       k: int) -> tuple[list[int], float, dict]:
    from asyncengine.interfaces.spec_decode import ProposalBatch

    target.cache.remove(["r"])
    proposer.remove(["r"])
    out = [target.forward(0, prompt, 0)[-1]]
    drafted = accepted = steps = 0
    start = time.perf_counter()
    while len(out) < n:
        history = prompt + out
        drafts = proposer.propose(ProposalBatch(token_ids=np.array([history]), num_tokens=np.array([len(history)]),
                                                request_ids=["r"]), k).as_lists()[0]
        drafts = drafts[:n - len(out) - 1]
        position = len(history) - 1
        argmax = target.forward(position, [history[-1]] + drafts, position)
        kept = 0
        while kept < len(drafts) and drafts[kept] == argmax[kept]:
            kept += 1
        out += drafts[:kept] + [argmax[kept]]
        drafted, accepted, steps = drafted + len(drafts), accepted + kept, steps + 1
    return out[:n], time.perf_counter() - start, {"drafted": drafted, "accepted": accepted, "steps": steps}


def llama_server_rates(target: Path, draft: Path, prompt: list[int], n: int, k: int, threads: int) -> dict:
    """Decode tokens per second of llama-server, plain and with --model-draft (its own timings)."""
    import llama_server

    rates = {}
    server = llama_server.find_binary("llama-server")
    speculative = ["--model-draft", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                   "--spec-draft-n-min", "0", "-td", str(threads)]
    for mode, extra in (("plain", []), ("draft", speculative)):
        port = llama_server._free_port()
        command = [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                   "-c", str(len(prompt) + n + 64), "-t", str(threads), "-tb", str(threads), "--no-webui", *extra]
        with llama_server.serving(command, port):
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False,
                    "samplers": ["top_k"], "top_k": 1}
            llama_server._post(port, dict(body, n_predict=8), timeout=600)  # warm-up
            answer = llama_server._post(port, body, timeout=3600)
        timings = answer.get("timings", {})
        rates[mode] = {"tok_s": timings.get("predicted_per_second"), "tokens": answer.get("tokens_predicted"),
                       "draft_n": timings.get("draft_n"), "draft_accepted": timings.get("draft_n_accepted")}
    return rates


def run_pair(target_path: Path, draft_path: Path, *, k: int, max_tokens: int, dtype: str, quantization: str | None,
             threads: int, header: str) -> None:
    from transformers import AutoTokenizer

    from asyncengine.config.speculative import parse_speculative_config
    from asyncengine.interfaces.spec_decode import ProposerContext, ProposerRegistry
    from asyncengine.platforms.cpu import CpuPlatform
    from asyncengine.plugin_runtime.platform_resolution import set_current_platform
    from asyncengine.worker.spec_decode.draft_model import resolve_draft_model_config

    torch.set_num_threads(threads)
    set_current_platform(CpuPlatform)
    target_config = resolve_draft_model_config(str(target_path), dtype=dtype)
    draft_config = resolve_draft_model_config(str(draft_path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_config.tokenizer_dir or target_config.model_dir)
    prompt_text = next(p for p in json.loads(WORKLOAD.read_text())["prompts"] if p["type"] == "code")["prompt"]
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    max_len = len(prompt) + max_tokens + k + 8
    print(f"{header}; pair: {target_path.name} <- {draft_path.name}; {dtype}, quantization {quantization}; "
          f"k={k}; one W6 code prompt ({len(prompt)} tokens), greedy, {max_tokens} tokens; {threads} threads")
    target = GreedyTarget(target_config, quantization, max_len)
    config = parse_speculative_config({"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": k})
    proposer = ProposerRegistry.proposer_class(config.method)(config, ProposerContext(
        vocab_size=target_config.vocab_size, max_model_len=max_len, max_num_seqs=1, dtype=dtype, block_size=BLOCK,
        platform=CpuPlatform, draft_model_config=draft_config, draft_quantization=quantization))
    proposer.load_model(target.model)
    print(f"  {proposer.describe()}")
    decode_alone(target, prompt[:32], 8)  # warm-up
    alone, alone_s = decode_alone(target, prompt, max_tokens)
    spec, spec_s, counts = decode_speculative(target, proposer, prompt, max_tokens, k)
    differ = next((i for i, (a, b) in enumerate(zip(alone, spec)) if a != b), None)
    decoded = max_tokens - 1
    print(f"  asyncengine (in-process harness) alone: {decoded / alone_s:.2f} tok/s decode; with draft: "
          f"{decoded / spec_s:.2f} tok/s ({alone_s / spec_s:.2f}x); acceptance {counts['accepted']}/{counts['drafted']}"
          f" = {counts['accepted'] / max(counts['drafted'], 1):.1%}, {decoded / counts['steps']:.2f} tokens per target "
          f"forward; outputs {'identical' if differ is None else f'differ from token {differ}'}")
    import llama_server

    try:
        rates = llama_server_rates(target_path, draft_path, prompt, max_tokens, k, threads)
    except (llama_server.Unavailable, OSError) as exc:  # not built, or it failed: said, and our figures stand
        print(f"  llama-server: not run ({type(exc).__name__}: {exc})")
        return
    plain, draft = rates["plain"], rates["draft"]
    ratio = (draft["tok_s"] / plain["tok_s"]) if plain["tok_s"] and draft["tok_s"] else float("nan")
    drafted = draft["draft_n"] or 0  # llama-server reports its drafts only when it made some
    print(f"  llama-server plain: {plain['tok_s']:.2f} tok/s; --model-draft: {draft['tok_s']:.2f} tok/s ({ratio:.2f}x);"
          f" acceptance {draft['draft_accepted'] or 0}/{drafted}")
    print(f"  load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
