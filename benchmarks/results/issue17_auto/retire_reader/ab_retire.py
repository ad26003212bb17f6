"""A/B, one process, interleaved: the auto policy retiring a hidden-state drafter that does not pay.

Methods (one shared target, transformers backend, greedy), run prompt by prompt in a rotating order:
  plain                   no drafter;
  default-retire          the default drafter (prompt lookup + the shipped conditioned drafter), auto policy (now);
  default-keep            the same with AutoPolicy(retire_readers=False): the conditioned drafter's hidden states
                          are computed every round, as before this change;
  lookup                  prompt lookup alone, auto policy (what the default can at best be where the drafter never
                          pays);
  conditioned-retire / conditioned-keep   the shipped conditioned drafter alone, auto policy, with and without.
Throughput ratio = total tokens / total time against plain's in the same run; every output is checked against plain's.

    python ab_retire.py [--sets humaneval mtbench champ] [--num-prompts 12] [--max-new-tokens 256] [--json OUT]
"""
import argparse
import json
import platform
import time

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.policies import AutoPolicy

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=12)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--methods", nargs="+",
                default=["plain", "default-retire", "default-keep", "lookup", "conditioned-retire", "conditioned-keep"])
ap.add_argument("--json")
args = ap.parse_args()

prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads
common = dict(backend="transformers", quiet=True)
build = {
    "plain": lambda: load_engine(drafter="none", policy="fixed", **common),
    "default-retire": lambda: load_engine(drafter="auto", policy=AutoPolicy(), **common),
    "default-keep": lambda: load_engine(drafter="auto", policy=AutoPolicy(retire_readers=False), **common),
    "lookup": lambda: load_engine(drafter="prompt-lookup", policy=AutoPolicy(), **common),
    "conditioned-retire": lambda: load_engine(drafter="conditioned", policy=AutoPolicy(), **common),
    "conditioned-keep": lambda: load_engine(drafter="conditioned", policy=AutoPolicy(retire_readers=False), **common),
}
engines = {m: build[m]() for m in args.methods}
for m, e in engines.items():
    print(m, e.drafter.describe() if e.drafter else "-", e.policy.describe(), flush=True)
for e in engines.values():  # warm-up: first calls pay one-off costs
    e.generate(prompts[0].text, max_new_tokens=32)

rows = []
names = list(engines)
for i, p in enumerate(prompts):
    order = names[i % len(names):] + names[:i % len(names)]
    ids = {}
    for m in order:
        t0 = time.perf_counter()
        r = engines[m].generate(p.text, max_new_tokens=args.max_new_tokens)
        wall = time.perf_counter() - t0
        ids[m] = r.token_ids
        rows.append({"method": m, "dataset": p.dataset, "prompt_id": p.prompt_id, "wall_s": wall,
                     "tokens": len(r.token_ids), "rounds": r.num_rounds, "target_passes": r.target_forward_passes,
                     "drafter_passes": r.drafter_forward_passes, "off_rounds": r.speculation_off_rounds,
                     "hidden_state_rounds": r.hidden_state_rounds, "draft_s": r.draft_time_s,
                     "verify_s": r.verify_time_s})
    for m in names:
        rows[-len(names) + order.index(m)]["equal_plain"] = ids[m] == ids.get("plain", ids[m])
    print(i, p.dataset, " ".join(f"{m}:{rows[-len(names)+order.index(m)]['wall_s']:.2f}" for m in names), flush=True)

summary = {}
for ds in args.sets + ["all"]:
    sel = [r for r in rows if ds == "all" or r["dataset"] == ds]
    tot = {m: (sum(r["tokens"] for r in sel if r["method"] == m), sum(r["wall_s"] for r in sel if r["method"] == m))
           for m in names}
    base = tot["plain"][0] / tot["plain"][1] if "plain" in tot else None
    summary[ds] = {m: {"tok_s": round(t / w, 2), "ratio": round(t / w / base, 4) if base else None,
                       "target_passes_per_prompt": round(sum(r["target_passes"] for r in sel if r["method"] == m)
                                                         / max(1, sum(1 for r in sel if r["method"] == m)), 1),
                       "drafter_passes_per_prompt": round(sum(r["drafter_passes"] for r in sel if r["method"] == m)
                                                          / max(1, sum(1 for r in sel if r["method"] == m)), 1),
                       "hidden_state_share": round(sum(r["hidden_state_rounds"] for r in sel if r["method"] == m)
                                                   / max(1, sum(r["rounds"] for r in sel if r["method"] == m)), 4),
                       "all_equal_plain": all(r["equal_plain"] for r in sel if r["method"] == m)}
                   for m, (t, w) in tot.items()}
    print(ds, json.dumps(summary[ds]))
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                   "rows": rows}, f, indent=1)
