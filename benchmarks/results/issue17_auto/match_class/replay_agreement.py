"""Offline replay: does agreement among a suffix n-gram's occurrences predict a copy, beside the match's length?
For each round of a bench run's prompt-lookup method with a match in the request (the current drafter's choice), the
share of the latest 16 occurrences whose next token equals the chosen copy's first token, and the copy's run. Also
per n-gram count (a suffix seen once against many times). No timing.

    python replay_agreement.py ../../issue16_training/bench_avx512_20x256_eleventh/results.jsonl > replay_agreement_eleventh.txt
"""
import collections
import json
import sys

import torch

from diffspec.backends import load_target
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from verify_curve import c  # the curve, beside this script


METHOD = "prompt-lookup:policy=auto"
rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if r["method"] == METHOD]
target = load_target(None, backend="transformers", quiet=True)
texts = {(d, p.prompt_id): p.text for d in ("humaneval", "mtbench", "champ") for p in load_bench_prompts(d, 20)}
cls = PromptLookupDrafter.length_class
by = collections.defaultdict(list)
data, rounds = [], collections.Counter()
for r in rows:
    prompt = list(target.encode_prompt(texts[(r["dataset"], r["prompt_id"])], chat=True))
    out, pos = r["token_ids"], 0
    index = NgramIndex(3, 2)
    for emitted in r["round_emitted"]:
        ids = prompt + out[:pos]
        m = index.find(torch.tensor(ids))
        if m.start >= 0:
            run = 0
            while m.start + run < len(ids) and pos + run < len(out) and ids[m.start + run] == out[pos + run]:
                run += 1
            ends = index.ends[tuple(ids[len(ids) - m.n:])][-16:]
            first = ids[m.start]
            agree = sum(ids[e] == first for e in ends) / len(ends)
            abucket = "1 occ" if len(ends) == 1 else "all agree" if agree == 1 else ">=1/2" if agree >= 0.5 else "<1/2"
            by[(cls(m.length), abucket)].append(run)
            data.append((r["dataset"], cls(m.length), abucket, run))
        rounds[r["dataset"]] += 1
        pos += emitted

print("match-length class, agreement of the latest 16 occurrences on the first copied token: rounds, P(run >= 1, 2, 4, 8)")
for key in sorted(by, key=lambda k: (k[0], ["1 occ", "all agree", ">=1/2", "<1/2"].index(k[1]))):
    runs = by[key]
    print(f"  class {key[0]:>2} {key[1]:>9}: {len(runs):5d}  " + " ".join(f"{sum(x >= k for x in runs) / len(runs):.2f}" for k in (1, 2, 4, 8)))

print("\nA fixed draft length per class, against one per (class, agreement), fitted on two sets, applied to the third"
      " (ms a token on the curve; rounds without a match are plain steps):")
for held in ("humaneval", "mtbench", "champ"):
    out = []
    for keyf in (lambda d: d[1], lambda d: (d[1], d[2])):
        fit = collections.defaultdict(list)
        for d in data:
            if d[0] != held:
                fit[keyf(d)].append(d[3])
        best = {key: max(range(65), key=lambda k: sum(min(x, k) + 1 for x in runs) / (len(runs) * c(k)))
                for key, runs in fit.items()}
        F, TF = 0.0, 0
        for d in data:
            if d[0] == held:
                k = best.get(keyf(d), 1)
                F, TF = F + c(k), TF + min(d[3], k) + 1
        u = rounds[held] - sum(1 for d in data if d[0] == held)
        out.append((F + u * c(0)) / (TF + u))
    print(f"  {held}: per class {out[0]:.3f} ms a token, per (class, agreement) {out[1]:.3f} ({out[0] / out[1]:.3f}x)")
