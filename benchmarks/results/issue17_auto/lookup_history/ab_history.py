"""A/B, one process, interleaved: prompt lookup that also copies from the earlier requests' prompts and answers
(`PromptLookupDrafter(history_tokens=N)`, SuffixDecoding's idea) against prompt lookup over the request alone.

Each engine keeps its own drafter, so each history holds only what that engine generated before, prompt by prompt
in the order given (HumanEval, then MT-Bench, then CHAMP); the warm-up is a prompt outside the sets, and the
history is cleared after it. Methods, in a rotating order per prompt: plain; lookup (history 0); lookup-history;
default (prompt lookup + the shipped conditioned drafter, auto policy); default-history. Auto policy throughout.
Throughput ratio = total tokens / total time against plain's in the same run; every output is checked.

    python ab_history.py [--sets humaneval mtbench champ] [--num-prompts 12] [--max-new-tokens 256]
                         [--history-tokens 65536] [--json OUT]
"""
import argparse
import json
import platform
import time

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafter_names import make_drafter
from diffspec.drafters import CombinedDrafter
from diffspec.drafters.prompt_lookup import PromptLookupDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=12)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--history-tokens", type=int, default=65536)
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads

plain = load_engine(drafter="none", policy="fixed", backend="transformers", quiet=True)
target = plain.target
H = args.history_tokens
conditioned = lambda: make_drafter("conditioned", target, compute_dtype="auto")
engines = {
    "plain": plain,
    "lookup": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy()),
    "lookup-history": SpeculativeEngine(target, PromptLookupDrafter(history_tokens=H), AutoPolicy()),
    "default": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(), conditioned()]), AutoPolicy()),
    "default-history": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(history_tokens=H), conditioned()]),
                                         AutoPolicy()),
}
for m, e in engines.items():
    print(m, e.drafter.describe() if e.drafter else "-", e.policy.describe(), flush=True)
for e in engines.values():  # warm-up on a prompt outside the sets, then an empty history
    e.generate("Tell me a short joke about cats.", max_new_tokens=32)
    for part in (e.drafter.parts if e.drafter is not None else ()):
        if isinstance(part, PromptLookupDrafter):
            part.begin(None)
            part._history = type(part._history)(part.max_ngram, part.min_ngram)

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
                  "off_rounds": r.speculation_off_rounds, "drafted": r.drafted_tokens, "accepted": r.accepted_tokens,
                  "draft_s": r.draft_time_s, "verify_s": r.verify_time_s}
    for m in names:
        got[m]["equal_plain"] = got[m]["ids"] == got["plain"]["ids"]
    for m in names:
        got[m].pop("ids")
        rows.append(got[m])
    print(i, p.dataset, " ".join(f"{m}:{got[m]['wall_s']:.2f}/{got[m]['target_passes']}" for m in names), flush=True)

summary = {}
for ds in args.sets + ["all"]:
    sel = [r for r in rows if ds == "all" or r["dataset"] == ds]
    pl = {r["prompt_id"]: r["wall_s"] for r in sel if r["method"] == "plain"}
    base = sum(r["tokens"] for r in sel if r["method"] == "plain") / sum(pl.values())
    summary[ds] = {}
    for m in names:
        mine = [r for r in sel if r["method"] == m]
        tokens, wall, rounds = sum(r["tokens"] for r in mine), sum(r["wall_s"] for r in mine), sum(r["rounds"] for r in mine)
        per = sorted(pl[r["prompt_id"]] / r["wall_s"] for r in mine)
        summary[ds][m] = {"tok_s": round(tokens / wall, 2), "ratio": round(tokens / wall / base, 4),
                          "per_prompt_median": round(per[len(per) // 2], 4), "per_prompt_min": round(per[0], 4),
                          "per_prompt_max": round(per[-1], 4),
                          "tokens_per_round": round(tokens / rounds, 3),
                          "target_passes_per_prompt": round(sum(r["target_passes"] for r in mine) / len(mine), 1),
                          "drafter_passes_per_prompt": round(sum(r["drafter_passes"] for r in mine) / len(mine), 1),
                          "off_share": round(sum(r["off_rounds"] for r in mine) / rounds, 4),
                          "all_equal_plain": all(r["equal_plain"] for r in mine)}
    print(ds, json.dumps(summary[ds]), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                   "rows": rows}, f, indent=1)
