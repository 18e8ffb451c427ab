"""Operations as a vLLM user expects them (issue 32, acceptance 5), on one real `asyncengine serve` whose C
kernel cache starts empty (XDG_CACHE_HOME points at a fresh directory):

- the start-up summary is logged before the server prints its address: the model with its dtype, weights'
  memory and load time, the KV cache's blocks and bytes, the maximum concurrency at max_model_len, the C
  kernels compiled, each process's start-up phases;
- the C kernels are compiled during start-up, with a progress line, and never inside the first request:
  the cache holds them when the address is printed, and the first request adds neither a library nor a
  compile line;
- every metric name that vLLM's published Grafana dashboard queries is on /metrics with a sample, under
  the served model's name, after one request.

The kernels' compile is what makes this module slow (about a minute on 2 idle cores, several when the
machine is busy): one server for all of it.
"""

from __future__ import annotations

import os
import re
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import start_server

# The metric names (with the _bucket/_sum/_count series they read) that vLLM's published Grafana dashboard
# queries: vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json (vllm:gpu_cache_usage_perc)
# and its later home examples/observability/prometheus_grafana/grafana.json (vllm:kv_cache_usage_perc instead).
GRAFANA_METRICS = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
SERVED = "tiny-ops"
MAX_MODEL_LEN = 512
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]
COMPILING = re.compile(r"compiling the (\w+) C kernels")


@pytest.fixture(scope="module")
def fresh_cache_server(tiny_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("empty-cache")
    kernels = cache / "asyncengine" / "kernels"
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), ASYNCENGINE_CPU_KERNELS="1")
    server = start_server([str(tiny_model("llama").path), "--served-model-name", SERVED, "--skip-tokenizer-init",
                           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 * 2**20)],
                          env=env, timeout=840)
    # What there was when the address was printed (the summary is logged before it).
    at_start = server.stderr(), sorted(path.name for path in kernels.glob("*.so"))
    yield server, kernels, at_start
    assert server.stop() == 0, server.stderr()[-3000:]


def complete(server) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    result = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 6


@pytest.mark.timeout(900)
def test_the_start_up_summary_comes_before_the_address(fresh_cache_server):
    _, _, (stderr, _) = fresh_cache_server
    summary = [line.split("asyncengine.startup: ", 1)[1] for line in stderr.splitlines()
               if "asyncengine.startup: " in line]
    expected = [
        rf"model {SERVED}: LlamaForCausalLM in \w+ on cpu: \d+\.\d+ [MG]iB of weights, loaded in \d+\.\d s",
        rf"KV cache: [\d,]+ blocks of 16 tokens \([\d,]+ tokens\), 8\.0 MiB in \w+; maximum concurrency for "
        rf"{MAX_MODEL_LEN} tokens per request: \d+\.\d\dx",
        r"C kernels: .*cpu_attention compiled in \d+\.\d s",
        r"start-up phases of the frontend: platform \d+\.\d\d s, .*engine core \d+\.\d\d s.*",
        r"start-up phases of the engine core: .*load model \d+\.\d\d s, kv cache \d+\.\d\d s.*",
    ]
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in summary), (pattern, summary)
    # The summary's order: the model, its KV cache, the kernels, then the phases.
    firsts = [next(i for i, line in enumerate(summary) if re.fullmatch(p, line)) for p in expected]
    assert firsts == sorted(firsts), summary


@pytest.mark.timeout(900)
def test_the_kernels_are_built_at_start_up_and_never_inside_the_first_request(fresh_cache_server):
    server, kernels, (stderr_at_start, built_at_start) = fresh_cache_server
    compiled = COMPILING.findall(stderr_at_start)
    assert "cpu_attention" in compiled and "cpu_fused" in compiled, stderr_at_start[-3000:]  # the cache was empty
    assert {name.split("-")[0] for name in built_at_start} >= {"cpu_attention", "cpu_fused"}
    complete(server)
    assert sorted(path.name for path in kernels.glob("*.so")) == built_at_start
    after = server.stderr()[len(stderr_at_start):]
    assert not COMPILING.search(after), after[-3000:]


@pytest.mark.timeout(900)
def test_every_metric_vllms_grafana_dashboard_queries_has_a_sample(fresh_cache_server):
    server, _, _ = fresh_cache_server
    complete(server)
    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    missing = [name for name in GRAFANA_METRICS if not found.get(name)]
    assert not missing, missing
    for name in GRAFANA_METRICS:
        assert all(sample.labels["model_name"] == SERVED for sample in found[name]), name
        assert all(sample.labels["engine"] == "0" for sample in found[name]), name
    # The request shows in them: counted, observed, and finished with its reason.
    assert sum(s.value for s in found["vllm:generation_tokens_total"]) >= 6
    assert sum(s.value for s in found["vllm:request_success_total"] if s.labels["finished_reason"] == "length") >= 1
    for histogram in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                      "vllm:time_per_output_token_seconds"):
        assert found[f"{histogram}_count"][0].value >= 1, histogram
    assert found["vllm:request_max_num_generation_tokens_sum"][0].value >= 6
