"""Offline replay: in the rounds of a bench run's prompt-lookup method where the request's own context had no match,
what a history of the earlier requests (their prompts and answers, in the bench's order, 65,536 tokens, the current
drafter's index) would have copied, per match-length class, and how long that copy would have run. No timing.

    python replay_history.py ../../issue16_training/bench_avx512_20x256_eleventh/results.jsonl > replay_history_eleventh.txt
"""
import collections
import json
import sys

import torch

from diffspec.backends import load_target
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter, find_continuation

METHOD = "prompt-lookup:policy=auto"
KEEP = 65536
rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if r["method"] == METHOD]
order = {"humaneval": 0, "mtbench": 1, "champ": 2}
target = load_target(None, backend="transformers", quiet=True)
prompts = {(d, p.prompt_id): (i, p.text) for d in order for i, p in enumerate(load_bench_prompts(d, 20))}
rows.sort(key=lambda r: (order[r["dataset"]], prompts[(r["dataset"], r["prompt_id"])][0]))
history = NgramIndex(3, 2)
cls = PromptLookupDrafter.length_class
stats = collections.defaultdict(list)  # (set, class) -> runs
nomatch = collections.Counter()
rounds = collections.Counter()
for r in rows:
    prompt = list(target.encode_prompt(prompts[(r["dataset"], r["prompt_id"])][1], chat=True))
    out, pos = r["token_ids"], 0
    for emitted in r["round_emitted"]:
        rounds[r["dataset"]] += 1
        ids = prompt + out[:pos]
        if find_continuation(torch.tensor(ids), 3, 2).start < 0:
            nomatch[r["dataset"]] += 1
            if history.ids:
                m = history.lookup(ids)
                if m.start >= 0:
                    run = 0
                    while m.start + run < len(history.ids) and pos + run < len(out) and history.ids[m.start + run] == out[pos + run]:
                        run += 1
                    stats[(r["dataset"], cls(m.length))].append(run)
        pos += emitted
    history.append(prompt + out, KEEP)

for ds in order:
    print(f"{ds}: {rounds[ds]} rounds, {nomatch[ds]} without a match in the request; with the history:")
    for c in sorted({c for d, c in stats if d == ds}):
        runs = stats[(ds, c)]
        print(f"  class {c:>2}: {len(runs):5d} rounds, P(run >= 1, 2, 4, 8) "
              + " ".join(f"{sum(x >= k for x in runs) / len(runs):.2f}" for k in (1, 2, 4, 8))
              + f", tokens a copy of 1 / 2 / 4 would add: {sum(min(x, 1) for x in runs)} / {sum(min(x, 2) for x in runs)}"
              f" / {sum(min(x, 4) for x in runs)}")
