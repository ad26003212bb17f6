"""A/B, one process, interleaved: prompt lookup before and after this change, on one shared target.

before (`prompt_lookup_before.py`, the drafter at 9bf06d4): the latest earlier occurrence of the longest suffix
        n-gram (3, else 2) is copied; its confidence is the request's acceptance rate of copies from n-gram matches
        of that n (prior n / 3). It runs under this session's policy code (the same for both sides: the cheaper
        length arithmetic and the shared empty draft), so the A/B isolates the drafter.
after:  of the latest 16 occurrences of that n-gram, the one whose match reaches furthest back (up to 64 tokens) is
        copied; confidence per match-length class (2, 3, 4-7, 8-15, 16-31, 32+; prior m / (m + 2)).

Methods, prompt by prompt in a rotating order: plain; lookup-before / lookup-after (prompt lookup alone, auto
policy); default-before / default-after (prompt lookup + the shipped conditioned drafter, auto policy: the default
drafter on the transformers backend). Throughput ratio = total tokens / total time against plain's in the same run;
every output is checked against plain's.

    python ab_longest_match.py [--sets humaneval mtbench champ] [--num-prompts 20] [--max-new-tokens 256]
                               [--kernels auto|q8] [--json OUT]
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafter_names import make_drafter
from diffspec.drafters import CombinedDrafter
from diffspec.drafters.prompt_lookup import PromptLookupDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_lookup_before import PromptLookupDrafter as LookupBefore  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--kernels", default="auto", help="the transformers backend's matmul choice (auto, q8, ...)")
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads


class Before(LookupBefore):
    def cost_signature(self):
        return "ngram index (before the longest match)"


plain = load_engine(drafter="none", policy="fixed", backend="transformers", kernels=args.kernels, quiet=True)
target = plain.target
conditioned = lambda: make_drafter("conditioned", target, compute_dtype="auto")  # noqa: E731
engines = {
    "plain": plain,
    "lookup-before": SpeculativeEngine(target, Before(), AutoPolicy()),
    "lookup-after": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy()),
    "default-before": SpeculativeEngine(target, CombinedDrafter([Before(), conditioned()]), AutoPolicy()),
    "default-after": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(), conditioned()]), AutoPolicy()),
}
for m, e in engines.items():
    print(m, e.drafter.describe() if e.drafter else "-", e.policy.describe(), flush=True)
for e in engines.values():  # warm-up: first calls pay one-off costs
    e.generate(prompts[0].text, max_new_tokens=32)

rows = []
names = list(engines)
for i, p in enumerate(prompts):
    order = names[i % len(names):] + names[:i % len(names)]
    got = {}
    for m in order:
        t0 = time.perf_counter()
        r = engines[m].generate(p.text, max_new_tokens=args.max_new_tokens)
        wall = time.perf_counter() - t0
        got[m] = {"method": m, "dataset": p.dataset, "prompt_id": p.prompt_id, "wall_s": wall,
                  "tokens": len(r.token_ids), "ids": r.token_ids, "rounds": r.num_rounds,
                  "target_passes": r.target_forward_passes, "drafter_passes": r.drafter_forward_passes,
                  "off_rounds": r.speculation_off_rounds, "hidden_state_rounds": r.hidden_state_rounds,
                  "drafted": r.drafted_tokens, "accepted": r.accepted_tokens,
                  "draft_s": r.draft_time_s, "verify_s": r.verify_time_s}
    for m in names:
        got[m]["equal_plain"] = got[m].pop("ids") == got["plain"]["ids"] if m != "plain" else True
        rows.append(got[m])
    got["plain"].pop("ids", None)
    print(i, p.dataset, " ".join(f"{m}:{got[m]['wall_s']:.2f}/{got[m]['target_passes']}" for m in names), flush=True)

summary = {}
for ds in args.sets + ["all"]:
    sel = [r for r in rows if ds == "all" or r["dataset"] == ds]
    base = sum(r["tokens"] for r in sel if r["method"] == "plain") / sum(r["wall_s"] for r in sel if r["method"] == "plain")
    summary[ds] = {}
    for m in names:
        mine = [r for r in sel if r["method"] == m]
        tokens, wall, rounds = sum(r["tokens"] for r in mine), sum(r["wall_s"] for r in mine), sum(r["rounds"] for r in mine)
        summary[ds][m] = {"tok_s": round(tokens / wall, 2), "ratio": round(tokens / wall / base, 4),
                          "per_prompt_ratio_median": round(sorted(
                              (next(b for b in sel if b["method"] == "plain" and b["prompt_id"] == r["prompt_id"])["wall_s"]
                               / r["wall_s"]) for r in mine)[len(mine) // 2], 4),
                          "tokens_per_round": round(tokens / rounds, 3),
                          "drafted_per_round": round(sum(r["drafted"] for r in mine) / rounds, 3),
                          "accepted_per_drafted": round(sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine)), 3),
                          "target_passes_per_prompt": round(sum(r["target_passes"] for r in mine) / len(mine), 1),
                          "drafter_passes_per_prompt": round(sum(r["drafter_passes"] for r in mine) / len(mine), 1),
                          "off_share": round(sum(r["off_rounds"] for r in mine) / rounds, 4),
                          "all_equal_plain": all(r["equal_plain"] for r in mine)}
    print(ds, json.dumps(summary[ds]), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                   "rows": rows}, f, indent=1)
