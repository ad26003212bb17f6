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


def best_rate(accept_probs: Sequence[float], verify_s: Sequence[float], draft_s: Sequence[float]) -> tuple:
    """(k, rate(k)) for the k in 0..K with the highest rate, the smallest such k: what `round_rates` gives, bitwise,
    in one loop without its lists (a policy asks this every round, of drafts up to 64 tokens long). Plain Python on
    purpose: right after a forward pass has streamed the weights through the caches, numpy's per-call overhead
    made this 3x slower in the engine (143 against 43 us a call) though it is faster in a hot loop."""
    K = len(accept_probs)
    if len(verify_s) < K + 1 or len(draft_s) < K + 1:
        raise ValueError(f"need costs for k = 0..{K}, got {len(verify_s)} verify and {len(draft_s)} draft entries")
    survive = total = 1.0
    best_k, best = 0, total / max(1e-12, float(draft_s[0]) + float(verify_s[0]))
    for k in range(1, K + 1):
        survive *= min(1.0, max(0.0, float(accept_probs[k - 1])))
        total += survive
        rate = total / max(1e-12, float(draft_s[k]) + float(verify_s[k]))
        if rate > best:
            best_k, best = k, rate
    return best_k, best


def best_length(accept_probs: Sequence[float], verify_s: Sequence[float], draft_s: Sequence[float],
                margin: float = 0.0) -> int:
    """The draft length in 0..K with the highest expected tokens per second. A k > 0 must beat plain
    decoding by `margin` (a share, e.g. 0.02) to be chosen: speculation that only ties is not worth
    its variance."""
    best, rate = best_rate(accept_probs, verify_s, draft_s)
    plain = 1.0 / max(1e-12, float(draft_s[0]) + float(verify_s[0]))
    return best if best == 0 or rate > plain * (1.0 + margin) else 0
