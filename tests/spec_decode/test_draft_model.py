"""The draft-model proposer on tiny random models: its drafts are the draft's own greedy continuation
(transformers' greedy decoding of the draft, the reference), across steps where the target rejects drafts
(the draft's cache is rolled back), for several requests in one batch; a draft equal to the target is
accepted in full by the rejection sampler; requests removed free their blocks; a full cache drafts nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.config.speculative import parse_speculative_config
from asyncengine.interfaces.spec_decode import ProposalBatch, ProposerContext, ProposerRegistry
from asyncengine.platforms.cpu import CpuPlatform
from support.hf_reference import hf_greedy
from support.platforms import use_platform
from support.tiny_models import build_tiny_model

K = 4
MAX_LEN = 256


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=3)


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)


def make_proposer(path, *, max_num_seqs=4, kv_bytes=None, vocab=997):
    config = parse_speculative_config({"model": str(path), "num_speculative_tokens": K})
    assert config.method == "draft_model"  # vLLM's older spelling: a model, no method
    proposer = ProposerRegistry.proposer_class(config.method)(config, ProposerContext(
        vocab_size=vocab, max_model_len=MAX_LEN, max_num_seqs=max_num_seqs, block_size=8, platform=CpuPlatform,
        draft_kv_cache_bytes=kv_bytes))
    proposer.load_model(None)
    return proposer


def batch_of(histories: list[list[int]], ids: list[str]) -> ProposalBatch:
    width = max(map(len, histories))
    tokens = np.zeros((len(histories), width), dtype=np.int64)
    for row, history in enumerate(histories):
        tokens[row, :len(history)] = history
    return ProposalBatch(token_ids=tokens, num_tokens=np.array([len(h) for h in histories]), request_ids=ids)


def test_drafts_are_the_drafts_greedy_continuation_across_rollbacks(draft_dir):
    proposer = make_proposer(draft_dir.path)
    assert "draft KV cache" in proposer.describe() and "MiB" in proposer.describe()
    generator = torch.Generator().manual_seed(0)
    histories = [torch.randint(3, 997, (n,), generator=generator).tolist() for n in (5, 17, 9)]
    ids = ["a", "b", "c"]
    for step in range(3):
        drafts = proposer.propose(batch_of(histories, ids), K)
        assert drafts.num_draft_tokens.tolist() == [K] * 3
        for row, history in enumerate(histories):
            want = hf_greedy(draft_dir.hf_model, history, K).token_ids
            assert drafts.as_lists()[row] == want, (step, row)
        # The "target" keeps a different number of drafts per request, then adds a token of its own (one
        # that differs from the next draft, so the draft's cached drafts past it are wrong).
        for row, history in enumerate(histories):
            kept = (step + row) % (K + 1)
            history += drafts.as_lists()[row][:kept]
            history.append(int(torch.randint(3, 997, (1,), generator=generator)))
    # A request that leaves frees its blocks; it may come back (preempted) and is recomputed.
    free = proposer.cache.free_blocks
    proposer.remove(["b"])
    assert proposer.cache.free_blocks > free and "b" not in proposer.cache.known()
    again = proposer.propose(batch_of(histories[1:2], ["b"]), K)
    assert again.as_lists()[0] == hf_greedy(draft_dir.hf_model, histories[1], K).token_ids


def test_drafts_stop_at_max_model_len(draft_dir):
    proposer = make_proposer(draft_dir.path)
    drafts = proposer.propose(batch_of([list(range(3, 3 + MAX_LEN - 2))], ["x"]), K)
    assert drafts.num_draft_tokens.tolist() == [2]


def test_a_full_draft_cache_drafts_nothing_for_what_it_cannot_hold(draft_dir):
    # Room for 3 blocks of 8 tokens (block 0 reserved): one request of 8 tokens and 3 drafts to hold fits, a
    # second does not.
    proposer = make_proposer(draft_dir.path, kv_bytes=3 * 2 * 2 * 8 * 2 * 16 * 4)
    assert proposer.cache.num_blocks == 3
    drafts = proposer.propose(batch_of([[5] * 8, [6] * 8], ["p", "q"]), K)
    assert drafts.num_draft_tokens.tolist() == [K, 0]
    proposer.remove(["p"])
    assert proposer.propose(batch_of([[6] * 8], ["q"]), K).num_draft_tokens.tolist() == [K]


def test_a_draft_equal_to_the_target_is_accepted_in_full(draft_dir):
    from asyncengine.wire.engine_core import SamplingOptions
    from asyncengine.worker.sampler import SamplingRow
    from asyncengine.worker.spec_decode.rejection_sampler import rejection_sample, target_distributions

    proposer = make_proposer(draft_dir.path)
    target = draft_dir.hf_model
    history = [7, 8, 9, 10]
    for _ in range(3):
        drafts = proposer.propose(batch_of([history], ["t"]), K)
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([history + drafts.as_lists()[0]])).logits[0, -(K + 1):]
        rows = [SamplingRow(options=SamplingOptions(temperature=0.0), prompt_token_ids=history, output_token_ids=[])]
        out = rejection_sample(torch.from_numpy(drafts.token_ids), [K], target_distributions(logits, rows, [K]),
                               [True])
        assert out.num_accepted == [K]
        history += out.as_lists()[0]


def test_a_gguf_draft_through_the_loader():
    """The default model's GGUF file as the draft (converted by the loader as a target would be): its drafts are
    transformers' greedy continuation of the converted checkpoint."""
    import transformers

    from asyncengine.loader.packaged_models import default_model_gguf_path

    proposer = make_proposer(default_model_gguf_path(), vocab=49152)
    assert proposer.draft_config.vocab_size == 49152
    history = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182]
    drafts = proposer.propose(batch_of([history], ["g"]), K)
    hf = transformers.AutoModelForCausalLM.from_pretrained(proposer.draft_config.model_dir, dtype=torch.float32)
    assert drafts.as_lists()[0] == hf_greedy(hf.eval(), history, K).token_ids
