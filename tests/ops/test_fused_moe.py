"""Op "fused_moe" (issue 35, acceptance 2): every implementation against the torch reference
(ops/fused_moe.py) over seeded random problems (moe_cases.py: top-k 1-8, M = 1, experts that get no token,
tokens that pick no expert held here), in float32 and bfloat16, within moe_cases.TOLERANCE.

- the CPU kernel (ops/cpu_moe.py) on plain weights, on weights reordered for oneDNN and (bfloat16, where the CPU
  has AMX) packed into AMX tiles, at decode sizes and at 600 tokens (experts of hundreds of rows), with its C
  combine kernel and with the torch sums it falls back to; on GGUF-style int8 block experts against the reference
  on the dequantized experts;
- the Triton kernel (ops/triton_moe.py) under the Triton interpreter, in a subprocess (triton_moe_checks.py);
- both on the rows a rank runs under expert parallelism (each for one of its experts, chosen alone);
- the routing that every implementation shares.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import torch
from kernel_device import device, run_checks
from moe_cases import as_rows_of_their_experts, coverage, make_case, max_error
from support.torch_threads import one_torch_thread

from asyncengine.ops import cpu_block_int8, cpu_moe, cpu_moe_decode
from asyncengine.ops.fused_moe import MoeConfig, check_arguments, fused_moe_reference, select_experts

CHECKS = Path(__file__).with_name("triton_moe_checks.py")
DTYPES = [torch.float32, torch.bfloat16]
SEEDS = range(40)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def cases() -> dict[torch.dtype, list]:
    return {dtype: [make_case(seed, dtype) for seed in SEEDS] for dtype in DTYPES}


def test_the_cases_reach_what_acceptance_2_names(cases):
    reached = coverage(cases[torch.float32])
    assert {"M=1", "expert without tokens", "token without held experts"} <= reached
    assert {f"top{k}" for k in range(1, 9)} <= reached


def packed(case, weights: str) -> cpu_moe.DenseExperts:
    """The case's experts as `weights` names: "plain", "oneDNN-reordered" or "AMX" (tiles for the AMX kernel)."""
    if weights == "plain":
        return cpu_moe.DenseExperts(case.w13, case.w2, case.w13_bias, case.w2_bias)
    experts = cpu_moe.DenseExperts.pack(case.w13, case.w2, case.w13_bias, case.w2_bias, amx=weights == "AMX")
    if weights == "AMX":
        assert experts.amx13 is not None, "the AMX kernel did not take these weights"
    else:
        assert experts.packed13 is not None, "oneDNN could not reorder the weights on this machine"
    return experts


def weight_kinds(dtype: torch.dtype) -> list[str]:
    return ["plain", "oneDNN-reordered"] + (["AMX"] if dtype == torch.bfloat16 and cpu_moe.amx_ready() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_kernel_matches_the_reference(cases, dtype):
    failures = []
    for weights in weight_kinds(dtype):
        for case in cases[dtype]:
            got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, packed(case, weights), case.config)
            want = fused_moe_reference(*case.args)
            error, allowed = max_error(got, want)
            if got.dtype != dtype or got.shape != want.shape or error > allowed:
                failures.append(f"{weights} {case.name}: max error {error:.3g} > {allowed:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_kernel_matches_the_reference_at_prefill_sizes(dtype):
    """600 tokens: experts with hundreds of rows (the oneDNN GEMMs; in AMX, more than one chunk of rows per
    expert), and with fewer, in one call."""
    failures = []
    for weights in weight_kinds(dtype):
        for seed in range(4):
            case = make_case(seed, dtype, tokens=600)
            got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, packed(case, weights), case.config)
            error, allowed = max_error(got, fused_moe_reference(*case.args))
            if error > allowed:
                failures.append(f"{weights} {case.name}: max error {error:.3g} > {allowed:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cpu_kernel_takes_widths_that_are_no_multiple_of_its_vectors(dtype):
    # The small-batch kernel's dot products run 32 (bfloat16) or 16 (float32) values at a time, masked at the end.
    for seed in range(12):
        case = make_case(seed, dtype, sizes=(40, 72), inners=(24, 36))
        got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, cpu_moe.DenseExperts.pack(
            case.w13, case.w2, case.w13_bias, case.w2_bias), case.config)
        error, allowed = max_error(got, fused_moe_reference(*case.args))
        assert error <= allowed, f"{case.name}: max error {error:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_the_c_kernels_torch_does_the_same(cases, dtype, monkeypatch):
    # (the grouping, the small-batch and AMX experts and the combine: all C where it is built; experts packed
    # for AMX before the kernels went away run through F.linear on their plain weights)
    kinds = ["plain"] + (["AMX"] if "AMX" in weight_kinds(dtype) else [])
    experts = {(kind, case.name): packed(case, kind) for kind in kinds for case in cases[dtype][:12]}
    with_kernel = {key: cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, experts[key], case.config)
                   for case in cases[dtype][:12] for key in [(kind, case.name) for kind in kinds]}
    assert cpu_moe.available(dtype), cpu_moe.unavailable_reason()
    monkeypatch.setattr(cpu_moe, "available", lambda dtype: False)
    for case in cases[dtype][:12]:
        for kind in kinds:
            got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, experts[kind, case.name], case.config)
            error, allowed = max_error(got, with_kernel[kind, case.name])
            assert error <= allowed, f"{kind} {case.name}"


@pytest.fixture(scope="module")
def decode_cases() -> dict[torch.dtype, list]:
    """1-4 tokens (the one-call decode path's sizes), seeded as the other cases."""
    return {dtype: [make_case(seed, dtype, tokens=1 + seed % cpu_moe_decode.TOKENS) for seed in range(80)]
            for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_one_call_decode_path_matches_the_reference_and_the_grouped_kernels(decode_cases, dtype, monkeypatch):
    """Up to cpu_moe_decode.TOKENS tokens the CPU kernel is one C call (ops/cpu_moe_decode.py): against the
    reference over top-k 1-8, experts that get no token, tokens that pick no expert held here; its results equal
    to the bit those of the grouped kernels it stands in for (the same arithmetic), on one thread and two (the
    work split over (expert, rows) changes no sum's order); each chosen expert counted once per token."""
    cases = decode_cases[dtype]
    assert {"M=1", "expert without tokens", "token without held experts"} <= coverage(cases)
    assert {f"top{k}" for k in range(1, 9)} <= coverage(cases)
    kinds, failures = weight_kinds(dtype), []
    experts = {(kind, case.name): packed(case, kind) for kind, case in product(kinds, cases)}
    calls = []
    run = cpu_moe_decode.run
    monkeypatch.setattr(cpu_moe_decode, "run", lambda *args: calls.append(1) or run(*args))

    def results() -> dict[tuple[str, str], torch.Tensor]:
        return {(kind, case.name): cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, experts[kind, case.name],
                                                         case.config) for kind, case in product(kinds, cases)}

    for kind, case in product(kinds, cases):
        counts = torch.zeros(case.router_logits.shape[1], dtype=torch.int64)
        got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, experts[kind, case.name], case.config,
                                    expert_tokens=counts)
        error, allowed = max_error(got, fused_moe_reference(*case.args))
        if got.dtype != dtype or error > allowed:
            failures.append(f"{kind} {case.name}: max error {error:.3g} > {allowed:.3g}")
        chosen = select_experts(case.router_logits, case.config)[1].reshape(-1)
        if not torch.equal(counts, torch.bincount(chosen, minlength=counts.numel())):
            failures.append(f"{kind} {case.name}: counted {counts.tolist()}")
    assert not failures, "\n".join(failures)
    assert len(calls) == len(experts), "the decode path did not take every case"
    one_thread = results()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two_threads = results()
    finally:
        torch.set_num_threads(previous)
    assert len(calls) == 3 * len(experts)
    monkeypatch.setattr(cpu_moe_decode, "takes", lambda tokens, top_k: False)
    grouped = results()
    assert len(calls) == 3 * len(experts)
    for key, want in grouped.items():
        assert torch.equal(one_thread[key], want), f"{key}: not the grouped kernels' result"
        assert torch.equal(two_threads[key], want), f"{key}: two threads differ from the grouped kernels"


def _block_quantized(w: torch.Tensor, draw: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int8 blocks of 32 with a float32 scale each, shaped like `w` `[out, in]`: (q, scale, dequantized)."""
    rows, width = w.shape
    q = torch.randint(-127, 128, (rows, width), generator=draw, dtype=torch.int8)
    scale = torch.rand(rows, width // cpu_block_int8.BLOCK, generator=draw) * (2.0 / 127 / width ** 0.5)
    return q, scale, cpu_block_int8.dequantize(q, scale, None, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gguf_block_experts_match_the_reference_on_their_dequantized_weights(dtype):
    if not cpu_block_int8.available(dtype):
        pytest.skip(f"the int8 block kernel is not built here: {cpu_block_int8.unavailable_reason()}")
    draw = torch.Generator().manual_seed(0)
    for seed in (4, 14, 44):  # M=1 with empty experts; a slice of the experts with tokens holding none of them
        case = make_case(seed, dtype)
        gate_up, down = [], []
        w13, w2 = torch.empty_like(case.w13, dtype=torch.float32), torch.empty_like(case.w2, dtype=torch.float32)
        for expert in range(case.w13.shape[0]):
            q, scale, w13[expert] = _block_quantized(case.w13[expert], draw)
            gate_up.append(cpu_block_int8.pack(q, scale, None))
            q, scale, w2[expert] = _block_quantized(case.w2[expert], draw)
            down.append(cpu_block_int8.pack(q, scale, None))
        experts = cpu_moe.BlockExperts(gate_up, down, case.w13_bias, case.w2_bias)
        got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, experts, case.config)
        # The reference in float32 on the dequantized experts: the kernel's only other difference is the
        # activations' quantization to int8 per block of 32 (ops/cpu_block_int8.py), about 0.4% per value.
        want = fused_moe_reference(case.hidden.float(), case.router_logits, w13, w2,
                                   None if case.w13_bias is None else case.w13_bias.float(),
                                   None if case.w2_bias is None else case.w2_bias.float(), case.config)
        error = float((got.float() - want).abs().max())
        assert got.dtype == dtype and error <= 3e-2 * max(1.0, float(want.abs().max())), f"{case.name}: {error}"


@pytest.fixture(scope="module")
def triton_results():
    found = run_checks(CHECKS, timeout=240)
    assert {r["device"] for r in found} == {device()}
    return found


def test_the_triton_kernel_matches_the_reference_under_the_interpreter(triton_results):
    assert len(triton_results) == 7, [r["name"] for r in triton_results]
    assert any("as rows of their experts" in r["name"] for r in triton_results)  # expert parallelism's input
    failed = [f"{r['name']}: {r['detail']}" for r in triton_results if not r["ok"]]
    assert not failed, "the Triton kernel differs from the reference:\n" + "\n".join(failed)
    reached = set().union(*(r["reached"] for r in triton_results))
    assert {"M=1", "top8", "expert without tokens", "token without held experts"} <= reached
    assert any("swigluoai bias=True" in r["name"] for r in triton_results)


# --- routing and arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_sent_by_expert_parallelism_get_their_experts_output_from_every_implementation(cases, dtype):
    """Under expert parallelism a rank runs the rows it received, each for one of its experts (routing that chooses
    it alone, weight 1): the reference gives that expert's output alone, and the CPU kernel matches it, within
    the tolerance (the GEMMs over a batch of rows sum in another order than over one)."""
    import torch.nn.functional as F

    from asyncengine.ops.fused_moe import activate

    for seed, full in enumerate(cases[dtype][:12]):
        case = as_rows_of_their_experts(full, seed)
        want = fused_moe_reference(*case.args)
        local = case.router_logits.argmax(dim=1) - case.config.first_expert
        for row, expert in enumerate(local.tolist()):
            bias13 = None if case.w13_bias is None else case.w13_bias[expert]
            bias2 = None if case.w2_bias is None else case.w2_bias[expert]
            alone = F.linear(activate(F.linear(case.hidden[row], case.w13[expert], bias13), case.config),
                             case.w2[expert], bias2)
            error, allowed = max_error(want[row:row + 1], alone[None])  # weight 1: the expert's output as is
            assert error <= allowed, f"{case.name}: row {row}: {error:.3g} > {allowed:.3g}"
        got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits,
                                    cpu_moe.DenseExperts.pack(case.w13, case.w2, case.w13_bias, case.w2_bias),
                                    case.config)
        error, allowed = max_error(got, want)
        assert error <= allowed, f"{case.name}: max error {error:.3g} > {allowed:.3g}"


def test_both_routings_choose_the_same_experts_and_renormalized_weights_agree():
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    for k in (1, 2, 8):
        plain, ids = select_experts(logits, MoeConfig(k))
        renormalized, same_ids = select_experts(logits, MoeConfig(k, renormalize=True))
        top_softmax, top_ids = select_experts(logits, MoeConfig(k, routing="topk_softmax"))
        assert torch.equal(ids, same_ids) and torch.equal(ids, top_ids)
        assert torch.equal(ids, torch.topk(logits, k, dim=-1).indices)
        assert torch.allclose(plain, torch.softmax(logits, -1).gather(1, ids))
        assert torch.allclose(renormalized.sum(-1), torch.ones(64)) and torch.allclose(renormalized, top_softmax)
        assert plain.dtype == torch.float32


def test_the_routing_reads_bfloat16_logits_in_float32():
    logits = torch.randn(8, 6).to(torch.bfloat16)
    weights, ids = select_experts(logits, MoeConfig(2))
    want_weights, want_ids = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
def test_no_tokens_give_an_empty_result(implementation):
    case = make_case(0, torch.bfloat16, tokens=0)
    if implementation == "reference":
        got = fused_moe_reference(*case.args)
    else:
        got = cpu_moe.fused_moe_cpu(case.hidden, case.router_logits, cpu_moe.DenseExperts(case.w13, case.w2),
                                    case.config)
    assert got.shape == (0, case.hidden.shape[1]) and got.dtype == torch.bfloat16


def test_mismatched_arguments_are_named():
    case = make_case(0, torch.float32)
    bad = {
        "w13 .* and w2": dict(w2=case.w2[:, :, :-1]),
        "router_logits": dict(router_logits=case.router_logits[:-1]),
        "w13_bias": dict(w13_bias=torch.zeros(1, 3)),
        "top_k 99": dict(config=MoeConfig(99)),
    }
    for message, change in bad.items():
        args = dict(hidden=case.hidden, router_logits=case.router_logits, w13=case.w13, w2=case.w2,
                    w13_bias=None, w2_bias=None, config=case.config) | change
        with pytest.raises(ValueError, match=message):
            check_arguments(**args)
    with pytest.raises(ValueError, match="routing must be one of"):
        MoeConfig(2, routing="sigmoid")
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        MoeConfig(0)

