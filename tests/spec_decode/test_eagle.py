"""EAGLE and EAGLE-3 proposers with heads built here, in their checkpoints' layouts (config.json and safetensors).

1. Random heads: the drafts over several steps (the target's hidden states given at random, some drafts
   "rejected" so the head's cache rolls back) equal those of a plain-torch re-implementation of the head's
   forward (`reference_*`, written from the published layouts, recomputing every row from scratch), and are
   valid target ids.
2. Heads whose weights make them propose the target's own greedy tokens, against a tiny target built for it
   (its attention's output projection zeroed, so its next token is a function of the current token, which a
   one-layer head can reproduce): every draft is accepted by the rejection sampler, step after step, with the
   target's hidden states taken from transformers' forward as the engine would pass them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.config.speculative import parse_speculative_config
from asyncengine.errors import ModelLoadError
from asyncengine.interfaces.spec_decode import ProposalBatch, ProposerContext, ProposerRegistry
from asyncengine.loader.model_loader import load_model
from asyncengine.platforms.cpu import CpuPlatform
from asyncengine.wire.engine_core import SamplingOptions
from asyncengine.worker.sampler import SamplingRow
from asyncengine.worker.spec_decode.draft_model import resolve_draft_model_config
from asyncengine.worker.spec_decode.rejection_sampler import rejection_sample, target_distributions
from support.eagle_heads import (
    EPS,
    HEADS,
    HIDDEN,
    KV_HEADS,
    THETA,
    VOCAB,
    bigram_llama,
    copying_head,
    head_config,
    random_tensors,
    save_head,
    transformers_llama,
)
from support.platforms import use_platform

K = 3


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    use_platform(monkeypatch, CpuPlatform)


# -- the plain-torch reference -----------------------------------------------------------------------------

def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotate(x, positions):  # NeoX halves, x [rows, heads, head_dim]
    half = x.shape[-1] // 2
    inverse = THETA ** (-torch.arange(0, half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions[:, None].double() * inverse[None]
    cos, sin = angles.cos()[:, None].float(), angles.sin()[:, None].float()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def attention(x, t, layer, positions, heads=HEADS, kv_heads=KV_HEADS, bias=False):
    head_dim = HIDDEN // heads

    def project(name, count):
        out = x @ t[f"{layer}.self_attn.{name}.weight"].T
        if bias:
            out = out + t[f"{layer}.self_attn.{name}.bias"]
        return out.view(len(x), count, head_dim)

    q = rotate(project("q_proj", heads), positions)
    k = rotate(project("k_proj", kv_heads), positions)
    v = project("v_proj", kv_heads)
    k, v = (y.repeat_interleave(heads // kv_heads, dim=1) for y in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim ** -0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x)).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), -1)
    out = out @ t[f"{layer}.self_attn.o_proj.weight"].T
    return out + t[f"{layer}.self_attn.o_proj.bias"] if bias else out


def mlp(x, t, layer):
    gate, up = x @ t[f"{layer}.mlp.gate_proj.weight"].T, x @ t[f"{layer}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{layer}.mlp.down_proj.weight"].T


def reference_eagle(t, embed, lm_head, tokens, hidden, positions):
    """(logits, fed-back state) of every row."""
    x = torch.cat([embed[tokens], hidden], dim=-1) @ t["fc.weight"].T + t["fc.bias"]
    x = x + attention(x, t, "layers.0", positions)
    out = x + mlp(rms(x, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0")
    return out @ lm_head.T, out


def reference_eagle3(t, embed, tokens, hidden, positions):
    """(target ids of the argmax, fed-back state) of every row; `hidden` rows are 3H (the target's) or H (own)."""
    hidden = torch.stack([h @ t["fc.weight"].T if len(h) == 3 * HIDDEN else h for h in hidden])
    x = torch.cat([rms(embed[tokens], t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)
    stream = attention(x, t, "midlayer", positions) + hidden
    prenorm = stream + mlp(rms(stream, t["midlayer.post_attention_layernorm.weight"]), t, "midlayer")
    draft = (rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return draft + t["d2t"][draft], prenorm


def reference_drafts(method, t, target, rows, k):
    """Drafts from the reference, given the rows so far [(token, hidden, position)]: recomputes every row."""
    rows = list(rows)
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    drafts = []
    for _ in range(k):
        tokens = torch.tensor([r[0] for r in rows])
        positions = torch.tensor([r[2] for r in rows])
        if method == "eagle":
            logits, fed = reference_eagle(t, embed, lm_head, tokens, torch.stack([r[1] for r in rows]), positions)
            token = int(logits[-1].argmax())
        else:
            ids, fed = reference_eagle3(t, embed, tokens, [r[1] for r in rows], positions)
            token = int(ids[-1])
        drafts.append(token)
        rows.append((token, fed[-1], rows[-1][2] + 1))
    return drafts


# -- fixtures ------------------------------------------------------------------------------------------------

def ours(hf_model, directory):
    hf_model.save_pretrained(directory)
    return load_model(resolve_draft_model_config(str(directory), dtype="float32"), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    hf = transformers_llama(2, seed=5)
    return hf, ours(hf, tmp_path_factory.mktemp("target"))


def build_proposer(method, path, target, *, max_model_len=256):
    config = parse_speculative_config({"method": method, "model": path, "num_speculative_tokens": K})
    proposer = ProposerRegistry.proposer_class(method)(config, ProposerContext(
        vocab_size=VOCAB, max_model_len=max_model_len, max_num_seqs=4, block_size=8, platform=CpuPlatform))
    proposer.load_model(target)
    return proposer


def batch(histories, ids, hidden_rows):
    width = max(map(len, histories))
    tokens = np.zeros((len(histories), width), dtype=np.int64)
    for i, h in enumerate(histories):
        tokens[i, :len(h)] = h
    return ProposalBatch(token_ids=tokens, num_tokens=np.array([len(h) for h in histories]), request_ids=ids,
                         hidden_states=torch.cat(hidden_rows), num_hidden_states=np.array([len(r) for r in hidden_rows]))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_head_drafts_match_the_reference(method, random_target, tmp_path):
    hf_target, target = random_target
    extra = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1], "draft_vocab_size": VOCAB - 97} \
        if method == "eagle3" else {}
    tensors = random_tensors(method, seed=11)
    proposer = build_proposer(method, save_head(tmp_path / "head", head_config(method, **extra), tensors), target)
    assert proposer.aux_hidden_state_layers == ((0, 1, 1) if method == "eagle3" else ())
    assert "head KV cache" in proposer.describe()
    width = 3 * HIDDEN if method == "eagle3" else HIDDEN
    generator = torch.Generator().manual_seed(2)
    histories = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (6, 11)]
    ids = ["a", "b"]
    given = [len(h) - 1 for h in histories]  # the prefill: every position but the last token's
    rows = {i: [] for i in ids}  # the reference's rows: (token j + 1, hidden j, j)
    for step in range(3):
        hidden_rows = [torch.randn(m, width, generator=generator) for m in given]
        for i, (history, m, fresh) in enumerate(zip(histories, given, hidden_rows)):
            first = len(history) - 1 - m
            rows[ids[i]] = [r for r in rows[ids[i]] if r[2] < first] + [
                (history[j + 1], fresh[j - first], j) for j in range(first, len(history) - 1)]
        drafts = proposer.propose(batch(histories, ids, hidden_rows), K)
        assert drafts.num_draft_tokens.tolist() == [K, K]
        assert ((drafts.token_ids >= 0) & (drafts.token_ids < VOCAB)).all()
        for i in range(2):
            assert drafts.as_lists()[i] == reference_drafts(method, tensors, hf_target, rows[ids[i]], K), (step, i)
        # Keep some drafts and a token of the target's; the target's states arrive for the kept positions.
        for i, history in enumerate(histories):
            kept = (step + i) % (K + 1)
            history += drafts.as_lists()[i][:kept] + [int(torch.randint(3, VOCAB, (1,), generator=generator))]
            given[i] = kept + 1
    proposer.remove(["a"])
    assert proposer.cache.known() == {"b"}


def test_a_d2t_outside_the_target_vocabulary_is_refused(random_target, tmp_path):
    tensors = random_tensors("eagle3", seed=1)
    tensors["d2t"] = torch.full((VOCAB - 97,), 200)
    config = head_config("eagle3", eagle_aux_hidden_state_layer_ids=[0, 1, 1], draft_vocab_size=VOCAB - 97)
    with pytest.raises(ModelLoadError, match="outside the target's 997"):
        build_proposer("eagle3", save_head(tmp_path / "bad", config, tensors), random_target[1])


# -- heads that propose the target's own greedy tokens ------------------------------------------------------

@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """A target whose next token depends on the current token only (support/eagle_heads.py: bigram_llama)."""
    hf = bigram_llama()
    return hf, ours(hf, tmp_path_factory.mktemp("bigram"))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_copying_the_target_is_accepted_in_full(method, bigram_target, tmp_path):
    hf, target = bigram_target
    config, tensors = copying_head(method, hf)
    proposer = build_proposer(method, save_head(tmp_path / "copy", config, tensors), target)
    layers = proposer.aux_hidden_state_layers

    def target_states(history):
        with torch.inference_mode():
            out = hf(input_ids=torch.tensor([history]), output_hidden_states=True)
        states = (torch.cat([out.hidden_states[i][0] for i in layers], dim=-1) if layers
                  else out.hidden_states[-1][0])
        return out.logits[0], states

    histories = [[5, 9, 14, 3], [40, 41]]
    for i, history in enumerate(histories):  # the prefill's token
        history.append(int(target_states(history)[0][-1].argmax()))
    given = [len(h) - 1 for h in histories]
    accepted = 0
    for _ in range(6):  # histories stay under 44 positions (copying_head's attention)
        hidden_rows = [target_states(h)[1][len(h) - 1 - m:len(h) - 1] for h, m in zip(histories, given)]
        drafts = proposer.propose(batch(histories, ["p", "q"], hidden_rows), K)
        for i, history in enumerate(histories):
            logits, _ = target_states(history + drafts.as_lists()[i])
            row = [SamplingRow(options=SamplingOptions(temperature=0.0), prompt_token_ids=history, output_token_ids=[])]
            out = rejection_sample(torch.from_numpy(drafts.token_ids[i:i + 1]), [K],
                                   target_distributions(logits[len(history) - 1:], row, [K]), [True])
            assert out.num_accepted == [K], (method, i, drafts.as_lists()[i], out.as_lists())
            accepted += K
            history += out.as_lists()[0]
            given[i] = K + 1
    assert accepted == 6 * 2 * K


def test_hidden_states_that_do_not_fit_the_batch_are_refused(random_target, tmp_path):
    proposer = build_proposer("eagle", save_head(tmp_path / "head", head_config("eagle"), random_tensors("eagle", 4)),
                              random_target[1])
    tokens = ProposalBatch(token_ids=np.array([[5, 6, 7]]), num_tokens=np.array([3]), request_ids=["x"])
    with pytest.raises(ValueError, match="hidden_states is required"):
        proposer.propose(tokens, K)
    tokens.hidden_states, tokens.num_hidden_states = torch.zeros(3, HIDDEN), np.array([3])
    with pytest.raises(ValueError, match="at most num_tokens - 1"):
        proposer.propose(tokens, K)
    tokens.num_hidden_states = np.array([2])
    with pytest.raises(ValueError, match="3 rows of hidden states"):
        proposer.propose(tokens, K)
    # No state given for a request this step: no drafts for it.
    tokens.hidden_states, tokens.num_hidden_states = torch.zeros(0, HIDDEN), np.array([0])
    assert proposer.propose(tokens, K).num_draft_tokens.tolist() == [0]
