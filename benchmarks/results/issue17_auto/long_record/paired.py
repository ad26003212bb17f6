"""Paired per-prompt comparison of two methods of an A/B's rows: the throughput ratio B over A (total tokens / total
time), its 95% bootstrap interval over prompts (2,000 resamples, seed 0), and how many prompts B ran faster.

    python paired.py ab_long_record_avx512.json lookup-old lookup-new
"""
import json
import random
import sys

rows = json.load(open(sys.argv[1]))["rows"]
a_name, b_name = sys.argv[2], sys.argv[3]
by = {}
for r in rows:
    by.setdefault((r["dataset"], r["prompt_id"]), {})[r["method"]] = r
pairs = [(v[a_name], v[b_name]) for v in by.values()]


def ratio(ps):
    return (sum(b["tokens"] for a, b in ps) / sum(b["wall_s"] for a, b in ps)) / \
           (sum(a["tokens"] for a, b in ps) / sum(a["wall_s"] for a, b in ps))


rng = random.Random(0)
boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(2000))
faster = sum(b["wall_s"] < a["wall_s"] for a, b in pairs)
print(f"{b_name} over {a_name}: {ratio(pairs):.4f}x, 95% bootstrap [{boot[50]:.4f}, {boot[1949]:.4f}], "
      f"faster on {faster} of {len(pairs)} prompts")
