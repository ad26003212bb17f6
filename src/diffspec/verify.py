"""Deciding which drafted tokens the target keeps. Pure tensor functions, no models.

One round verifies k drafted tokens d_1..d_k with k+1 target distributions p_1..p_{k+1}, where
p_i is the target's distribution for the position of d_i (p_{k+1} follows d_k).

- **accepted** tokens: the longest prefix d_1..d_n the target keeps.
- **recovered** token: when d_{n+1} is rejected, the target's replacement for it, drawn from
  norm(max(0, p_{n+1} - q_{n+1})) (greedy: the target's argmax).
- **bonus** token: when all k are accepted, one more token drawn from p_{k+1} for free.

Every round therefore emits n + 1 tokens (accepted + exactly one recovered or bonus token), and
the emitted sequence has exactly the target's distribution (Leviathan et al. 2023, Chen et al.
2023): greedily it equals the target's argmax decoding token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # n: drafted tokens kept
    next_token: int    # the recovered (n < k) or bonus (n == k) token
    is_bonus: bool


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy acceptance. draft_tokens [k] int64; target_logits [k+1, V]."""
    return verify_greedy_choices(draft_tokens, target_logits.argmax(dim=-1))


def verify_greedy_choices(draft_tokens: torch.Tensor, choice: torch.Tensor) -> Verdict:
    """Greedy acceptance from the target's own choices. draft_tokens [k] int64; choice [k+1] int64 (the
    argmax of each row of the verify pass: TargetOutput.greedy_tokens())."""
    k = draft_tokens.shape[0]
    assert choice.shape == (k + 1,), (tuple(draft_tokens.shape), tuple(choice.shape))
    chosen, drafted = choice.tolist(), draft_tokens.tolist()  # k + 1 ints: a list walk beats ~6 tiny tensor ops
    n = 0
    while n < k and chosen[n] == drafted[n]:
        n += 1
    return Verdict(n, chosen[n], n == k)


def verify_rejection(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     target_probs: torch.Tensor, generator: Optional[torch.Generator]) -> Verdict:
    """Rejection sampling (speculative sampling).

    draft_tokens [k] int64, each drawn from the matching row of draft_probs.
    draft_probs  [k, V] q, or None for one-hot q (deterministic drafts: q(d_i) = 1).
    target_probs [k+1, V] p, already processed with the request's temperature/top-k/top-p.
    Token d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)).
    """
    k = draft_tokens.shape[0]
    assert target_probs.shape[0] == k + 1, (tuple(draft_tokens.shape), tuple(target_probs.shape))
    if draft_probs is not None:
        assert draft_probs.shape == (k, target_probs.shape[1]), (tuple(draft_probs.shape), tuple(target_probs.shape))
    n = k
    if k:
        idx = draft_tokens.unsqueeze(-1)
        p = target_probs[:k].gather(-1, idx).squeeze(-1)  # [k]
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1).to(p.dtype)
        u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)
        accept = u * q < p  # u < p/q without dividing; p == 0 is never accepted
        rejected = (~accept).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
    if n == k:
        return Verdict(k, int(sample(target_probs[k:k + 1], generator)[0]), True)
    p_row = target_probs[n]
    if draft_probs is None:
        q_row = torch.zeros_like(p_row)
        q_row[draft_tokens[n]] = 1.0
    else:
        q_row = draft_probs[n].to(p_row.dtype)
    residual = torch.clamp(p_row - q_row, min=0.0)
    total = residual.sum()
    residual = residual / total if total > 0 else p_row  # p == q on the support: cannot reject, keep p
    return Verdict(n, int(sample(residual.unsqueeze(0), generator)[0]), False)
