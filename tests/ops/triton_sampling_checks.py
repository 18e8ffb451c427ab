"""Run by test_triton_sampling.py in a child process: the "sample" kernel (ops/triton_sampling.py)
against its torch reference, on CPU under the Triton interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported) or compiled on CUDA when ASYNCENGINE_KERNEL_DEVICE=cuda. Fresh random
inputs from CHECK_SEED; the kernel's outputs (scratch included) are poisoned before each run. Prints
one JSON line per check: {"name", "ok", "detail"}.

The in-kernel draw is checked two ways: exactly, against `philox_exponential` below (Triton's
Philox, as `tl.randint` computes it, written again in numpy) fed to the reference; and statistically,
by the frequencies of many draws from a 4-token vocabulary of known probabilities.
"""

from __future__ import annotations

import json
import os
import sys

DEVICE = os.environ.get("ASYNCENGINE_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernels are checked under the Triton interpreter), "
             "or with ASYNCENGINE_KERNEL_DEVICE=cuda on a GPU machine")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from asyncengine.ops.triton_sampling import sample_reference, sample_triton  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 (no matmul here, but none may sneak in)
torch.backends.cudnn.allow_tf32 = False
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
generator = torch.Generator().manual_seed(int(os.environ.get("CHECK_SEED", "0")))
# Draws for the frequency checks: the interpreter runs one program in some 20 ms, so few there.
STAT_ROWS = 300 if DEVICE == "cpu" else 100_000


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)


def random_seeds(n):
    return torch.randint(-2**63, 2**63 - 1, (n,), generator=generator, dtype=torch.int64).to(DEVICE)


def poisoned(fn, *args, **kwargs):
    """Run fn with torch.empty returning NaN (floats) or the most negative int (integers), so a value
    the kernel never wrote shows (as a NaN score or a negative token)."""
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        dtype = dtype or torch.get_default_dtype()
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)

    torch.empty = empty
    try:
        return fn(*args, **kwargs)
    finally:
        torch.empty = real_empty


def philox_exponential(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """E of the in-kernel draw, [rows, vocab]: Philox4x32-10 (Triton's constants) with key = the
    row's seed (low, high 32 bits) and counter (column, 0, 0, 0); U from the top 24 bits of the first
    output word, centred; E = -log(U)."""
    mask = np.uint64(0xFFFFFFFF)
    seed = seeds.cpu().numpy().astype(np.int64).astype(np.uint64)[:, None]
    k0, k1 = seed & mask, seed >> np.uint64(32)
    c0 = np.broadcast_to(np.arange(vocab, dtype=np.uint64), (len(seed), vocab)).copy()
    c1, c2, c3 = np.zeros_like(c0), np.zeros_like(c0), np.zeros_like(c0)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # 32 x 32 bits: exact in 64
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    u = ((c0 >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    return torch.from_numpy(-np.log(u)).to(DEVICE)


def tokens_check(name, got, logits, temperature, noise):
    """Kernel tokens against the reference's on the same E: equal, except where the reference's own
    scores tie to rounding (the kernel's division and log may round differently; on a GPU its log is
    the fast one). Greedy rows must be equal exactly: no arithmetic there."""
    want = sample_reference(logits, temperature, noise)
    if got.shape != want.shape or got.dtype != torch.int64 or got.device.type != want.device.type:
        return dict(name=name, ok=False, detail=f"got {got.dtype} {tuple(got.shape)} on {got.device}")
    x = logits.float()
    greedy = temperature == 0
    scores = torch.where(greedy.unsqueeze(1), x, x / torch.where(greedy, 1.0, temperature).unsqueeze(1) - noise.log())
    differ = (got != want).nonzero().flatten().tolist()
    bad = []
    for row in differ:
        token = int(got[row])
        if greedy[row] or not 0 <= token < x.shape[1]:
            bad.append(row)
            continue
        best, mine = scores[row, want[row]].item(), scores[row, token].item()
        if best - mine > 1e-5 * max(1.0, abs(best)):
            bad.append(row)
    return dict(name=name, ok=not bad, detail=f"{len(differ)} of {len(got)} rows differ (ties to rounding "
                                               f"allowed); wrong rows {bad[:5]}")


def chi_square(name, tokens, probs):
    """Pearson's statistic over the 4 tokens (3 degrees of freedom): 30.7 is its 1e-6 upper quantile."""
    n = len(tokens)
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    expected = probs.double() * n
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return dict(name=name, ok=statistic < 30.7 and len(counts) == len(probs),
                detail=f"chi2 {statistic:.2f} over {n} draws; frequencies {(counts / n).tolist()} vs {probs.tolist()}")


# Greedy rows (0), ordinary, sharp and flat temperatures, the smallest random one (vLLM's 1e-5).
TEMPERATURES = [0.0, 1.0, 0.5, 1e-5, 100.0, 0.0, 2.0]


def checks():
    temperature = torch.tensor(TEMPERATURES, device=DEVICE)
    batch = len(TEMPERATURES)
    for dtype in DTYPES:
        tag = str(dtype).removeprefix("torch.")
        # vocab 300 in tiles of 64 over up to 4 programs a row: a partial last tile, several splits;
        # vocab 1000 in one program with the default tile (1024, partial).
        for vocab, options in [(300, dict(block=64, target_programs=3 * batch)), (1000, {})]:
            logits = rand(batch, vocab, dtype=dtype, scale=3.0)
            noise = torch.empty(batch, vocab).exponential_(generator=generator).to(DEVICE)
            got = poisoned(sample_triton, logits, temperature, random_seeds(batch), noise, **options)
            yield tokens_check(f"given noise {tag} vocab={vocab}", got, logits, temperature, noise)
            seeds = random_seeds(batch)
            got = poisoned(sample_triton, logits, temperature, seeds, None, **options)
            yield tokens_check(f"in-kernel philox {tag} vocab={vocab}", got, logits, temperature,
                               philox_exponential(seeds, vocab))
        # Greedy ties: few distinct values, so every row's maximum repeats; the first index wins.
        ties = torch.randint(0, 4, (batch, 300), generator=generator).to(dtype).to(DEVICE)
        zeros = torch.zeros(batch, device=DEVICE)
        got = poisoned(sample_triton, ties, zeros, random_seeds(batch), None, block=64, target_programs=3 * batch)
        yield dict(name=f"greedy ties first index {tag}", ok=torch.equal(got, ties.float().argmax(dim=-1)),
                   detail=f"{got.tolist()} vs torch.argmax {ties.float().argmax(dim=-1).tolist()}")

    # Masked tokens (-inf, as top_k/top_p leave them) are never drawn; an all -inf row gives 0.
    logits = torch.full((batch, 200), float("-inf"), device=DEVICE)
    allowed = torch.tensor([3, 77, 150, 199])
    logits[:-1, allowed] = rand(batch - 1, len(allowed))
    ones = torch.ones(batch, device=DEVICE)
    got = poisoned(sample_triton, logits, ones, random_seeds(batch), None, block=64, target_programs=3 * batch)
    drawn = set(got[:-1].tolist())
    yield dict(name="masked tokens never drawn", ok=drawn <= set(allowed.tolist()) and int(got[-1]) == 0,
               detail=f"tokens {got.tolist()}, allowed {allowed.tolist()} (last row all -inf: 0)")

    # The draw is a function of the row's seed: the same seeds give the same tokens, whatever the
    # tiling and split, and whatever else is in the batch; other seeds give other tokens.
    vocab = 500
    flat = rand(1, vocab, scale=0.1).repeat(64, 1)
    seeds = random_seeds(64)
    ones = torch.ones(64, device=DEVICE)
    first = sample_triton(flat, ones, seeds, block=64, target_programs=64 * 8)
    again = sample_triton(flat, ones, seeds)
    alone = torch.cat([sample_triton(flat[i:i + 1], ones[:1], seeds[i:i + 1], block=128) for i in range(0, 64, 9)])
    yield dict(name="same seed same token", ok=torch.equal(first, again) and torch.equal(first[::9], alone),
               detail=f"{first[:8].tolist()} / {again[:8].tolist()} / alone {alone[:4].tolist()}")
    other = sample_triton(flat, ones, random_seeds(64))
    yield dict(name="other seeds other tokens", ok=len(set(first.tolist())) > 32 and int((first != other).sum()) > 48,
               detail=f"{len(set(first.tolist()))} distinct of 64 over a near-flat vocab of {vocab}; "
                      f"{int((first != other).sum())} of 64 changed with other seeds")

    # Frequencies: the in-kernel draw follows softmax(logits / T).
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for t in (1.0, 0.5):
        seeds = torch.arange(STAT_ROWS, dtype=torch.int64, device=DEVICE) * 7919 + 12345
        logits = probs.log().to(DEVICE).repeat(STAT_ROWS, 1)
        got = sample_triton(logits, torch.full((STAT_ROWS,), t, device=DEVICE), seeds)
        yield chi_square(f"frequencies kernel T={t}", got, torch.softmax(probs.log() / t, dim=0))
    # The same draw at 200000 rows through the numpy Philox: the noise's design (24-bit U, centred),
    # at a size that shows a bias of a few tenths of a percent.
    rows = 200_000
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 12345
    noise = philox_exponential(seeds, 4)
    got = sample_reference(probs.log().to(DEVICE).repeat(rows, 1), torch.ones(rows, device=DEVICE), noise)
    yield chi_square("frequencies philox noise T=1.0", got, probs)


for result in checks():
    result["device"] = DEVICE
    print(json.dumps(result), flush=True)
