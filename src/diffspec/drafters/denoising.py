"""Pure functions shared by the diffusion drafters: attention masks, the unmasking rule, and when
a parallel draft's q may be handed to rejection sampling.

Why the last one matters. Rejection sampling at position i needs d_i ~ q_i given everything the
verifier has already conditioned on (the accepted d_<i). A token unmasked at step t was drawn
conditioned on the tokens unmasked before t; if one of those sits to its RIGHT, the acceptance of
earlier positions carries information about d_i and q_i is no longer its distribution, so
min(1, p/q) would bias the output. Tokens drawn in the same step (independently) or in
left-to-right step order are fine. Otherwise the draft is verified with one-hot q (accept d_i with
probability p(d_i), recover from p without d_i), which is exact for any way of choosing d_i.
"""

from __future__ import annotations

from typing import Sequence

import torch


def block_causal_mask(q_len: int, past_len: int, block_size: int, device=None) -> torch.Tensor:
    """[1, 1, q_len, past_len + q_len] bool, True = may attend.

    Queries are the positions past_len .. past_len+q_len-1, keys 0 .. past_len+q_len-1. A query
    sees every key whose block (position // block_size) is not later than its own: causal across
    blocks, bidirectional inside a block.
    """
    q_pos = torch.arange(past_len, past_len + q_len, device=device)
    k_pos = torch.arange(past_len + q_len, device=device)
    visible = (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)
    return visible[None, None]


def full_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """[1, 1, q_len, kv_len] all True: bidirectional attention."""
    return torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device)


def select_unmask(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which masked positions to unmask this step: those whose confidence exceeds the threshold,
    and always at least the most confident one. confidences [m] -> sorted indices [<= m]."""
    chosen = (confidences > threshold).nonzero().flatten()
    if chosen.numel() == 0:
        chosen = confidences.argmax().view(1)
    return chosen.sort().values


def select_top(confidences: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` most confident positions (SpecDiff's per-step rule). [m] -> sorted indices."""
    count = max(1, min(count, confidences.numel()))
    return torch.topk(confidences, count).indices.sort().values


def left_to_right_steps(steps: Sequence[int]) -> bool:
    """True when the step at which each drafted token was unmasked never decreases from left to
    right: then each token's q is its true conditional and rejection sampling may use it."""
    return all(a <= b for a, b in zip(steps, steps[1:]))
