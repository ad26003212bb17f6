"""The verify curve the replays value draft lengths on: the eleventh session's in-engine medians (HumanEval x 8,
`../lookup_longest_match/round_overhead_avx512_820183f.txt`), ms at k = 0, 1, 2, 4, 8; linear between, and beyond 8
at the 4..8 slope."""

CURVE = {0: 6.87, 1: 8.20, 2: 10.68, 4: 14.71, 8: 23.97}


def c(k: int) -> float:
    ks = sorted(CURVE)
    if k in CURVE:
        return CURVE[k]
    for a, b in zip(ks, ks[1:]):
        if a < k < b:
            return CURVE[a] + (CURVE[b] - CURVE[a]) * (k - a) / (b - a)
    return CURVE[8] + (k - 8) * (CURVE[8] - CURVE[4]) / 4
