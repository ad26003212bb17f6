"""Draft-length choice as pure functions of a cost table and acceptance estimates.

    p[i]        P(draft i+1 is accepted | drafts 1..i were), i = 0..K-1
    E(k)        expected emitted tokens of a round that verifies k drafts = 1 + sum_{i<=k} prod_{j<=i} p[j]
                (the 1 is the target's own recovered or bonus token)
    cost(k)     expected seconds of that round = draft_s[k] + verify_s[k]
    rate(k)     E(k) / cost(k), tokens per second; rate(0) is plain decoding (draft_s[0] = 0)

`best_length` returns the k in 0..K with the highest rate. It looks at every k, not only until the
rate first drops: on a CPU, a 2-token verify can cost much more than a 1-token step (GEMV -> GEMM)
while 4 tokens cost barely more than 2, so k = 1 may lose to plain decoding and k = 4 win.
"""

from __future__ import annotations

from typing import Sequence


def expected_emitted(accept_probs: Sequence[float]) -> list:
    """[E(0), E(1), .., E(K)] for conditional acceptance probabilities p[0..K-1]."""
    out, survive, total = [1.0], 1.0, 1.0
    for p in accept_probs:
        survive *= min(1.0, max(0.0, float(p)))
        total += survive
        out.append(total)
    return out


def round_rates(accept_probs: Sequence[float], verify_s: Sequence[float], draft_s: Sequence[float]) -> list:
    """rate(k) for k = 0..K, K = len(accept_probs); verify_s and draft_s hold at least K + 1 entries."""
    emitted = expected_emitted(accept_probs)
    if len(verify_s) < len(emitted) or len(draft_s) < len(emitted):
        raise ValueError(f"need costs for k = 0..{len(emitted) - 1}, got {len(verify_s)} verify and "
                         f"{len(draft_s)} draft entries")
    return [e / max(1e-12, float(draft_s[k]) + float(verify_s[k])) for k, e in enumerate(emitted)]


def best_length(accept_probs: Sequence[float], verify_s: Sequence[float], draft_s: Sequence[float],
                margin: float = 0.0) -> int:
    """The draft length in 0..K with the highest expected tokens per second. A k > 0 must beat plain
    decoding by `margin` (a share, e.g. 0.02) to be chosen: speculation that only ties is not worth
    its variance."""
    rates = round_rates(accept_probs, verify_s, draft_s)
    best = max(range(len(rates)), key=lambda k: (rates[k], -k))
    return best if best == 0 or rates[best] > rates[0] * (1.0 + margin) else 0
