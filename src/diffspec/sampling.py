"""Turning logits into the distribution a token is drawn from. Pure tensor functions, no models.

The same transform (temperature, then top-k, then top-p) is applied to the target's logits and to
a drafter's logits, so rejection sampling compares like with like.
"""

from __future__ import annotations

from typing import Optional

import torch

from .types import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to `logits` [n, V]; removed entries become -inf.

    Requires params.temperature > 0 (greedy decoding never builds a distribution).
    top-p keeps the smallest set of most likely tokens whose probability reaches top_p
    (the most likely token is always kept).
    """
    assert params.temperature > 0, "filter_logits is for sampling; greedy uses argmax"
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] probabilities under `params` (temperature > 0)."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Draw one token per row of `probs` [n, V] -> [n] int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> Optional[torch.Generator]:
    """One generator per request: seeded when params.seed is set, random otherwise."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(int(params.seed))
    else:
        gen.seed()
    return gen
