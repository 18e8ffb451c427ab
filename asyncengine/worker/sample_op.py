"""Op "sample": the sampler's draw, one token per row, run through the op providers (op_registry).

    sample(logits, temperature, seeds, noise) -> tokens

- `logits` `[B, V]`, float32, float16 or bfloat16: what is left to draw from (after penalties, and
  after min_p/top_k/top_p where a row asks for them: masked tokens are -inf);
- `temperature` `[B]` float32: 0 marks a greedy row, whose token is the argmax (the first index of
  the maximum); any other row draws from softmax(logits / T) with the exponential race,
  argmax(softmax(logits / T) / E), E ~ Exp(1) per token;
- `seeds` `[B]` int64: one seed per row, for a provider that draws E itself (noise is None);
- `noise` `[B, V]` float32, or None: the E to use. When given, every provider must draw with it, so
  that providers agree token for token (the Sampler gives it on every device but CUDA, drawn from
  torch generators as before this op existed); when None, a provider draws E from `seeds`, a
  function of the seed alone (the triton provider does so in the kernel, with Philox).

Returns the tokens, int64 `[B]`, on the logits' device (no copy to the host: the caller decides when).

`sample_native` is the torch reference and the "native" provider. With noise it computes exactly
what the Sampler computed before the op existed (the same tensors, the same order), so CPU runs draw
the same tokens. Without noise it seeds one torch generator per random row from `seeds`: a fallback
that reads the seeds on the host and runs a loop, correct but slow; the triton provider is the fast
path there.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def sample_native(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  noise: torch.Tensor | None) -> torch.Tensor:
    x = logits.float()
    greedy = temperature == 0
    tokens = x.argmax(dim=-1)
    if noise is None:
        random_rows = (~greedy).nonzero().flatten().tolist()
        if not random_rows:
            return tokens
        noise = _noise_from_seeds(seeds, random_rows, x.shape, x.device)
    # Greedy rows are divided by 1 (their draw is discarded below): one division for the batch.
    scaled = x / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    drawn = (torch.softmax(scaled, dim=-1) / noise).argmax(dim=-1)
    return torch.where(greedy, tokens, drawn)


def _noise_from_seeds(seeds: torch.Tensor, random_rows: list[int], shape: torch.Size,
                      device: torch.device) -> torch.Tensor:
    noise = torch.ones(shape, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    values = seeds.tolist()
    for row in random_rows:
        generator.manual_seed(values[row] & _MASK64)
        noise[row].exponential_(generator=generator)
    return noise
