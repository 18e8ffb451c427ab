"""The decode path of asyncengine/worker/cuda_graphs.py: static buffers padded to fixed batch sizes.

On a GPU these buffers feed captured CUDA graphs; here (no CUDA) the same padded path runs eagerly, which
checks what the graphs depend on: the copies into the static buffers, the padding rows (slot -1, context 0)
changing nothing, and the attention backend reading only device tensors in a decode step.

The model runs on TRITON_PAGED (the backend the CUDA platform picks and the one that is safe to capture),
under the Triton interpreter, in a child process: triton.jit reads TRITON_INTERPRET when a kernel module is
imported, so it must be set before that and must not leak into this session. The child is this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from asyncengine.worker.cuda_graphs import DecodeGraphs, capture_sizes

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (5, 17, 9, 33, 2)
# Requests finish at least three steps apart (whatever step each one's prompt lands in, as they reach the
# engine core over a few ticks), so the decode batch passes through 3 sequences, which run padded to 4.
MAX_TOKENS = (14, 11, 8, 5, 2)
MAX_NUM_SEQS = 6


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    graphs = DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), max_batch_size=40, max_blocks_per_seq=4,
                          block_size=16, capture=False)
    assert [graphs.size_for(n) for n in (1, 3, 8, 9, 33, 40, 41)] == [1, 4, 8, 16, 40, 40, None]


class _RecordingModel(torch.nn.Module):
    """Returns its input ids as hidden states and keeps what the padded path handed it."""

    def forward(self, input_ids, positions, metadata):
        self.seen = dict(input_ids=input_ids.clone(), positions=positions.clone(),
                         slots=metadata.slot_mapping.clone(), seq_lens=metadata.seq_lens_tensor.clone(),
                         tables=metadata.block_tables.clone(), max_seq_len=metadata.max_seq_len)
        return input_ids.float().unsqueeze(1)


def _decode_metadata(slots, seq_lens, tables):
    from asyncengine.models.layers.attention import AttentionMetadata

    n = len(slots)
    return AttentionMetadata(torch.tensor(slots), None, [1] * n, seq_lens, torch.tensor(tables), block_size=16)


def test_padding_rows_store_nothing_and_attend_to_nothing_after_a_larger_step():
    model = _RecordingModel()
    graphs = DecodeGraphs(model, torch.device("cpu"), max_batch_size=6, max_blocks_per_seq=4, block_size=16,
                          capture=False)
    # A step of 6 leaves real values in every row of the static buffers ...
    graphs.run(torch.arange(100, 106), torch.arange(6) + 20,
               _decode_metadata([5, 21, 37, 53, 69, 85], [21] * 6, [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]))
    # ... then a step of 5 runs in the same size-6 buffers: row 5 must not keep the old slot or length.
    hidden = graphs.run(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([40, 41, 42, 43, 44]),
                        _decode_metadata([9, 10, 11, 12, 13], [41, 42, 43, 44, 45], [[6, 7, 8]] * 5))
    seen = model.seen
    assert hidden.squeeze(1).tolist() == [7, 8, 9, 10, 11]  # only the real rows come back
    assert seen["slots"].tolist() == [9, 10, 11, 12, 13, -1]
    assert seen["seq_lens"].tolist() == [41, 42, 43, 44, 45, 0]
    assert seen["positions"][:5].tolist() == [40, 41, 42, 43, 44]
    assert seen["tables"][:5, :3].tolist() == [[6, 7, 8]] * 5
    assert seen["tables"].shape == (6, 4)  # the full width: the grid is sized from it, not from the lengths
    assert seen["max_seq_len"] is None
    assert graphs.runs == {(6, 6): 1, (5, 6): 1}
    with pytest.raises(ValueError, match="decode steps of at most 6"):
        graphs.run(torch.arange(7), torch.arange(7), _decode_metadata(list(range(7)), [1] * 7, [[0]] * 7))


@pytest.fixture(scope="module")
def child_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "worker"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"the child failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_padded_decode_gives_the_eager_tokens_and_transformers_greedy(child_results, name):
    result = child_results[name]
    assert result["padded"] == result["eager"], "padding rows changed a real row's tokens"
    assert [len(t) for t in result["padded"]] == list(MAX_TOKENS)
    # compare_greedy (tests/support/hf_reference.py) raised in the child on any mismatch that is not a tie.
    assert sum(result["compared"]) > 0
    assert sum(result["compared"]) + sum(result["tie_tail"]) == sum(MAX_TOKENS)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decode_steps_ran_padded_to_the_captured_sizes(child_results, name):
    result = child_results[name]
    assert result["sizes"] == [1, 2, 4, 6]
    runs = result["runs"]
    graphs = DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), max_batch_size=MAX_NUM_SEQS,
                          max_blocks_per_seq=1, block_size=16, capture=False)
    assert all(size == graphs.size_for(n) for n, size, _ in runs), runs
    assert any(n == 3 and size == 4 for n, size, _ in runs), f"no step ran 3 sequences padded to 4: {runs}"
    # Every step after the longest request's first token decoded it, and each of those was decode-only
    # once the last prompt was in: at least that many steps went through the padded path.
    assert sum(count for _, _, count in runs) >= max(MAX_TOKENS) - len(MAX_TOKENS), runs


def _child() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from asyncengine import LLM, SamplingParams
    from support.hf_reference import compare_greedy, hf_greedy
    from support.tiny_models import build_tiny_model

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run by tests/worker/test_decode_graphs.py with TRITON_INTERPRET=1")
    prompts = [[(7 * i + 3 * n) % 900 + 1 for i in range(n)] for n in PROMPT_LENGTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in ("llama", "qwen3"):
            tiny = build_tiny_model(name, Path(workdir) / name)
            result = {}
            for mode in ("eager", "padded"):
                with LLM(str(tiny.path), skip_tokenizer_init=True, attention_backend="TRITON_PAGED",
                         max_num_seqs=MAX_NUM_SEQS, max_model_len=128, kv_cache_memory_bytes=8 * 2**20,
                         worker_extension_cls="padded_decode_extension:PaddedDecode") as llm:
                    if mode == "padded":
                        result["sizes"] = llm.collective_rpc("use_padded_decode")[0]
                    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    if mode == "padded":
                        result["runs"] = llm.collective_rpc("padded_decode_runs")[0]
                result[mode] = [list(o.outputs[0].token_ids) for o in outputs]
            compared, tie_tail = [], []
            for prompt, tokens, n in zip(prompts, result["padded"], MAX_TOKENS):
                comparison = compare_greedy(tokens, None, hf_greedy(tiny.hf_model, prompt, n))
                compared.append(comparison.num_compared)
                tie_tail.append(n - comparison.num_compared if comparison.tie else 0)
            result["compared"], result["tie_tail"] = compared, tie_tail
            results[name] = result
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child()
