"""Offline replay of a bench run's prompt-lookup rounds (no timing): what predicts a copy's length, and how much the
choice of occurrence and of draft length could give. Reads a `diffspec bench` results.jsonl with plain and
`prompt-lookup:policy=auto` rows; the verify curve (ms at k = 0, 1, 2, 4, 8) is this session's in-engine medians.

    python offline_replay.py ../../issue16_training/bench_avx512_20x256_tenth/results.jsonl > offline_replay.txt
"""
import collections
import json
import sys

import torch

from diffspec.backends import load_target
from diffspec.bench.prompts import load_bench_prompts

METHOD = "prompt-lookup:policy=auto"
CURVE = {0: 6.87, 1: 8.20, 2: 10.68, 4: 14.71, 8: 23.97}  # ms, HumanEval x 8, in the engine (round_overhead)


def c(k):
    ks = sorted(CURVE)
    if k in CURVE:
        return CURVE[k]
    for a, b in zip(ks, ks[1:]):
        if a < k < b:
            return CURVE[a] + (CURVE[b] - CURVE[a]) * (k - a) / (b - a)
    return CURVE[8] + (k - 8) * (CURVE[8] - CURVE[4]) / 4


def back(ids, end, n, cap=64):
    """How far back the match ending at the continuation start `end` reaches (the old drafter's latest occurrence)."""
    L = n
    while L < cap and end - L - 1 >= 0 and ids[end - L - 1] == ids[len(ids) - L - 1]:
        L += 1
    return L


def run_of(ids, out, pos, start):
    run = 0
    while start + run < len(ids) and pos + run < len(out) and ids[start + run] == out[pos + run]:
        run += 1
    return run


def cls(L):
    return "2" if L == 2 else "3" if L == 3 else "4-5" if L <= 5 else "6-9" if L <= 9 else "10-19" if L <= 19 else "20+"


rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if r["method"] == METHOD]
target = load_target(None, backend="transformers", quiet=True)
texts = {(d, p.prompt_id): p.text for d in ("humaneval", "mtbench", "champ") for p in load_bench_prompts(d, 20)}
data, occ, rounds_per_set = [], collections.Counter(), collections.Counter()
for r in rows:
    prompt = list(target.encode_prompt(texts[(r["dataset"], r["prompt_id"])], chat=True))
    out, pos, prev_full = r["token_ids"], 0, False
    for drafted, accepted, emitted in zip(r["round_drafted"], r["round_accepted"], r["round_emitted"]):
        rounds_per_set[r["dataset"]] += 1
        ids = prompt + out[:pos]
        for n in (3, 2):  # the suffix n-gram's occurrences among the windows that end before the last token
            ends = [i + n for i in range(len(ids) - n) if ids[i:i + n] == ids[-n:]]
            if ends:
                break
        if ends:
            latest = ends[-1]
            L = back(ids, latest, n)
            data.append((r["dataset"], L, run_of(ids, out, pos, latest), drafted, accepted, prev_full))
            furthest = max(ends[-16:], key=lambda e: (back(ids, e, n), e))
            occ["rounds"] += 1
            occ["differs"] += furthest != latest
            occ["run_latest"] += run_of(ids, out, pos, latest)
            occ["run_furthest"] += run_of(ids, out, pos, furthest)
        prev_full = drafted > 0 and accepted == drafted
        pos += emitted

print(f"{len(data)} rounds with a match, of {sum(rounds_per_set.values())}")
print("\n1. How far back the latest match reaches (L) against the copy's run (tokens it would get right):")
by = collections.defaultdict(list)
for ds, L, run, d, a, pf in data:
    by[cls(L)].append((run, d, a))
for b in ("2", "3", "4-5", "6-9", "10-19", "20+"):
    xs = by[b]
    runs = [x[0] for x in xs]
    print(f"  L {b:>5}: rounds {len(xs):5d}, mean run {sum(runs) / len(runs):5.2f}, P(run >= 1, 2, 4, 8, 16) "
          + " ".join(f"{sum(r >= k for r in runs) / len(runs):.2f}" for k in (1, 2, 4, 8, 16))
          + f"; the policy drafted {sum(x[1] for x in xs) / len(xs):.2f}, accepted {sum(x[2] for x in xs) / len(xs):.2f}")
print(f"\n2. Of the latest 16 occurrences, the one reaching furthest back: differs from the latest in "
      f"{occ['differs']} of {occ['rounds']} rounds; runs {occ['run_latest']} (latest) against {occ['run_furthest']}")


def bucket(L):
    return 2 if L == 2 else 3 if L == 3 else 4 if L <= 5 else 6 if L <= 9 else 10 if L <= 19 else 20 if L <= 39 else 40


print("\n3. Draft length chosen per (L class, previous round fully accepted), fitted on two sets, applied to the third"
      " (estimated ms a token on the verify curve above; rounds without a match are plain steps in both):")
for held in ("humaneval", "mtbench", "champ"):
    fit = collections.defaultdict(list)
    for ds, L, run, d, a, pf in data:
        if ds != held:
            fit[(bucket(L), pf)].append(run)
    best = {key: max(range(33), key=lambda k: sum(min(r, k) + 1 for r in runs) / (len(runs) * c(k)))
            for key, runs in fit.items()}
    A = F = 0.0
    TA = TF = 0
    for ds, L, run, d, a, pf in data:
        if ds != held:
            continue
        A, TA = A + c(d), TA + a + 1
        k = best.get((bucket(L), pf), 1)
        F, TF = F + c(k), TF + min(run, k) + 1
    u = rounds_per_set[held] - sum(1 for x in data if x[0] == held)
    whole_a, whole_f = (A + u * c(0)) / (TA + u), (F + u * c(0)) / (TF + u)
    print(f"  {held}: matched rounds {A / TA:.2f} -> {F / TF:.2f} ms a token; whole run {whole_a:.3f} -> {whole_f:.3f}"
          f" ({whole_a / whole_f:.3f}x)")
