"""Greedy match rate of two methods of a `diffspec bench` folder, prompt by prompt: how many prompts
give identical tokens, and how many tokens agree before the first difference.

    python benchmarks/results/issue19_engine/scripts/match_rate.py BENCH_FOLDER [A plain] [B hf-generate]
"""
import json
import sys
from pathlib import Path

folder = Path(sys.argv[1])
a, b = (sys.argv[2:4] + ["plain", "hf-generate"][len(sys.argv[2:4]):])[:2]
rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
by = {(r["dataset"], r["prompt_id"], r["method"]): r["token_ids"] for r in rows}
prompts = sorted({(d, p) for d, p, m in by if m == a and (d, p, b) in by})
same, agree, total, firsts = 0, 0, 0, []
for d, p in prompts:
    x, y = by[(d, p, a)], by[(d, p, b)]
    n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    identical = x == y
    same += identical
    agree += len(x) if identical else n
    total += len(x)
    if not identical:
        firsts.append(f"{d}/{p}@{n}")
print(f"{a} vs {b}: {same}/{len(prompts)} prompts identical; {agree}/{total} of {a}'s tokens before the first "
      f"difference ({100 * agree / max(1, total):.1f}%)")
if firsts:
    print("first differences (new token index):", ", ".join(firsts))
