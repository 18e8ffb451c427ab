"""The compiled-grammar cache under distinct large JSON schemas (issue 30, item 2): engine-core memory stays bounded.

    python bench/structured_cache.py                          # 200 schemas of 2,000 properties, a 256 MiB budget
    python bench/structured_cache.py --count 50 --properties 1000 --cache-bytes 67108864

Starts `asyncengine serve` on the default model (float32, a 256 MiB KV cache) with `--structured-outputs-cache-bytes`,
sends each schema once as a chat completion's `response_format` (max_tokens 1: the grammar is compiled and its
matcher built; one token is sampled under its mask), one at a time, and prints the engine core's RSS at the start
(after one unconstrained request) and every `--every` schemas: the RSS, its growth, the cache's bytes and entries
(/metrics), and the grammar-compile process's RSS (a separate process, started at the first schema over 16 KiB).
The last line is the summary: acceptance is an engine-core RSS within budget + 300 MB of its start.

Each schema has distinct property names (so no two share a compiled grammar) cycling through integer, bounded
string, boolean, number and enum properties. Before issue 30, 150 such schemas took the engine core from 4.3 to
7.7 GB (about 23 MB each, never released).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

KINDS = ({"type": "integer"}, {"type": "string", "maxLength": 16}, {"type": "boolean"}, {"type": "number"},
         {"enum": ["red", "green", "blue"]})
SERVING = re.compile(r"^asyncengine: serving .* on (http://\S+)$", re.MULTILINE)


def schema(index: int, num_properties: int) -> dict:
    return {"type": "object", "properties": {f"s{index}_p{k}": KINDS[k % len(KINDS)] for k in range(num_properties)}}


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def child(pid: int, module: str) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and module.encode() in command:
            return int(entry)
    return None


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics") as response:
        text = response.read().decode()
    return {name: float(value) for name, value in
            re.findall(r"^asyncengine:(structured_outputs_cache_\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE)}


def default_model_dir() -> str:
    from asyncengine.loader.gguf import convert_gguf_to_hf_dir, default_model_gguf_path

    return str(convert_gguf_to_hf_dir(default_model_gguf_path(), progress=False))  # ~/.cache/asyncengine (or its env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--properties", type=int, default=2000)
    parser.add_argument("--cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--model", default=None, help="a model directory (default: the default model, converted)")
    args = parser.parse_args()
    model = args.model or default_model_dir()
    logs = Path(tempfile.mkdtemp(prefix="structured-cache-"))
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", model, "--port", "0", "--dtype",
                                   "float32", "--kv-cache-memory-bytes", str(256 * 2**20), "--max-model-len", "2048",
                                   "--structured-outputs-cache-bytes", str(args.cache_bytes)],
                                  stdout=stdout, stderr=stderr)
    try:
        while not (match := SERVING.search((logs / "stdout").read_text())):
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {(logs / 'stderr').read_text()[-2000:]}")
            time.sleep(0.2)
        url = match.group(1)
        core = child(server.pid, "asyncengine.engine_core.process")
        post(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        start = rss_mb(core)
        print(f"structured_cache: {args.count} schemas of {args.properties} properties, budget "
              f"{args.cache_bytes / 2**20:.0f} MiB; engine core (pid {core}) RSS at start {start:.0f} MB; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        began = time.monotonic()
        for index in range(args.count):
            post(url, {"messages": [{"role": "user", "content": "A document"}], "max_tokens": 1,
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": f"s{index}", "schema": schema(index, args.properties)}}})
            if (index + 1) % args.every == 0 or index + 1 == args.count:
                cache = metrics(url)
                now = rss_mb(core)
                print(f"  {index + 1:4d} schemas, {time.monotonic() - began:6.0f} s: engine core RSS {now:.0f} MB "
                      f"({now - start:+.0f}); cache {cache['structured_outputs_cache_bytes'] / 2**20:.0f} MiB in "
                      f"{cache['structured_outputs_cache_entries']:.0f} grammars; compile process RSS "
                      f"{rss_mb(child(core, 'asyncengine.structured_output.compiler_main')):.0f} MB", flush=True)
        end = rss_mb(core)
        bound = start + args.cache_bytes / 2**20 + 300
        print(f"structured_cache: engine core RSS {start:.0f} -> {end:.0f} MB ({end - start:+.0f} MB) after "
              f"{args.count} schemas in {time.monotonic() - began:.0f} s ({(time.monotonic() - began) / args.count:.2f} "
              f"s each); bound start + budget + 300 MB = {bound:.0f} MB: {'within' if end <= bound else 'OVER'}; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
