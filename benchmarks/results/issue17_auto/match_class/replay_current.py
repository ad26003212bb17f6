"""Offline replay of a bench run's prompt-lookup rounds under the current drafter (longest match of the latest 16):
per match-length class, what the policy drafted and had accepted, against how long the copy would have run; and how
much a draft length chosen per class (fitted on two sets, applied to the third) could give on the verify curve.
No timing: the curve is the eleventh session's in-engine medians (round_overhead_avx512_820183f.txt).

    python replay_current.py ../../issue16_training/bench_avx512_20x256_eleventh/results.jsonl > replay_eleventh.txt
"""
import collections
import json
import sys

import torch

from diffspec.backends import load_target
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from verify_curve import c  # the curve, beside this script

METHOD = sys.argv[2] if len(sys.argv) > 2 else "prompt-lookup:policy=auto"


def run_of(ids, out, pos, start):
    run = 0
    while start + run < len(ids) and pos + run < len(out) and ids[start + run] == out[pos + run]:
        run += 1
    return run


rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if r["method"] == METHOD]
target = load_target(None, backend="transformers", quiet=True)
texts = {(d, p.prompt_id): p.text for d in ("humaneval", "mtbench", "champ") for p in load_bench_prompts(d, 20)}
data, rounds_per_set = [], collections.Counter()
for r in rows:
    prompt = list(target.encode_prompt(texts[(r["dataset"], r["prompt_id"])], chat=True))
    out, pos = r["token_ids"], 0
    for drafted, accepted, emitted in zip(r["round_drafted"], r["round_accepted"], r["round_emitted"]):
        rounds_per_set[r["dataset"]] += 1
        ids = prompt + out[:pos]
        m = find_continuation(torch.tensor(ids), 3, 2)
        if m.start >= 0:
            data.append((r["dataset"], m.length, run_of(ids, out, pos, m.start), drafted, accepted))
        pos += emitted

cls = PromptLookupDrafter.length_class
print(f"{len(data)} rounds with a match, of {sum(rounds_per_set.values())} ({METHOD})")
print("\n1. Per match-length class (1, 2, 3, 4-7, 8-15, 16-31, 32+): the copy's run against what the policy did")
by = collections.defaultdict(list)
for ds, L, run, d, a in data:
    by[cls(L)].append((run, d, a))
for b in sorted(by):
    xs = by[b]
    runs = [x[0] for x in xs]
    best = max(range(65), key=lambda k: sum(min(r, k) + 1 for r in runs) / (len(runs) * c(k)))
    print(f"  class {b:>2}: rounds {len(xs):5d}, mean run {sum(runs) / len(runs):5.2f}, P(run >= 1, 2, 4, 8, 16, 32) "
          + " ".join(f"{sum(r >= k for r in runs) / len(runs):.2f}" for k in (1, 2, 4, 8, 16, 32))
          + f"; policy drafted {sum(x[1] for x in xs) / len(xs):5.2f}, accepted {sum(x[2] for x in xs) / len(xs):5.2f};"
          f" best fixed k {best}")
    hist = collections.Counter(x[1] for x in xs)
    print("            drafted-length histogram: " + ", ".join(f"{k}:{v}" for k, v in sorted(hist.items())))

print("\n2. Draft length per class, fitted on two sets, applied to the third (ms a token on the curve):")
for held in ("humaneval", "mtbench", "champ"):
    fit = collections.defaultdict(list)
    for ds, L, run, d, a in data:
        if ds != held:
            fit[cls(L)].append(run)
    best = {key: max(range(65), key=lambda k: sum(min(r, k) + 1 for r in runs) / (len(runs) * c(k)))
            for key, runs in fit.items()}
    A = F = 0.0
    TA = TF = 0
    for ds, L, run, d, a in data:
        if ds != held:
            continue
        A, TA = A + c(d), TA + a + 1
        k = best.get(cls(L), 1)
        F, TF = F + c(k), TF + min(run, k) + 1
    u = rounds_per_set[held] - sum(1 for x in data if x[0] == held)
    whole_a, whole_f = (A + u * c(0)) / (TA + u), (F + u * c(0)) / (TF + u)
    print(f"  {held}: matched rounds {A / TA:.2f} -> {F / TF:.2f} ms a token; whole run {whole_a:.3f} -> {whole_f:.3f}"
          f" ({whole_a / whole_f:.3f}x); k per class {dict(sorted(best.items()))}")
