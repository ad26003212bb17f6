"""A/B, one process, interleaved: this session's two `auto` changes, before and after, on one shared target.

before: a source runs every greedy round when its fitted cost of one drafted token is under 2% of a plain step
        (prompt lookup's, 0.17-0.24 ms beside an 8.4 ms step, was not: it was switched off in 85-95% of rounds and
        missed copies), prompt lookup scans the whole context every run, and a drafter that reads the target's
        hidden states gets them every round;
after:  the 2% is judged on what a run costs, drafts or not (`look_cost`), prompt lookup keeps an n-gram index,
        and a hidden-state drafter whose probes keep losing is retired (`retire_readers`).
The rest of this session's engine changes (the greedy verdict as a list walk, one shared empty draft, the
acceptance estimates per cell) run in both.

Methods, prompt by prompt in a rotating order: plain; lookup-before / lookup-after (prompt lookup alone, auto
policy); default-before / default-after (prompt lookup + the shipped conditioned drafter, auto policy: the default
drafter on the transformers backend); conditioned-after (the conditioned drafter alone, auto policy). Throughput
ratio = total tokens / total time against plain's in the same run; every output is checked against plain's.

    python ab_auto_rules.py [--sets humaneval mtbench champ] [--num-prompts 12] [--max-new-tokens 256] [--json OUT]
"""
import argparse
import json
import platform
import time

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafter_names import make_drafter
from diffspec.drafters import CombinedDrafter
from diffspec.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=12)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads


class PolicyBefore(AutoPolicy):
    def __init__(self):
        super().__init__(retire_readers=False)

    def is_cheap(self, src):
        return src.draft_cost(1) < self.cheap_share * self._curve[0]


class ScanLookup(PromptLookupDrafter):
    """The scan over every window of the context, a token added at a time (the drafter before the index)."""

    def propose(self, context, policy, limit, sampling, generator):
        from diffspec.drafters.base import DraftBuilder

        self._learn_from(context)
        start, n = find_continuation(context, self.max_ngram, self.min_ngram)
        builder = DraftBuilder()
        if start < 0:
            return builder.build(0, context.device)
        confidence = self.confidence(n)
        source = context[start:].tolist()
        for k in builder.increments(policy, limit):
            for token in source[len(builder): len(builder) + k]:
                builder.add(token, confidence)
        if len(builder):
            self._last = (int(context.shape[0]), list(builder.tokens), n)
        return builder.build(0, context.device)

    def cost_signature(self):
        return "scan"


plain = load_engine(drafter="none", policy="fixed", backend="transformers", quiet=True)
target = plain.target
engines = {
    "plain": plain,
    "lookup-before": SpeculativeEngine(target, ScanLookup(), PolicyBefore()),
    "lookup-after": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy()),
    "default-before": SpeculativeEngine(target, CombinedDrafter([ScanLookup(), make_drafter("conditioned", target,
                                                                                         compute_dtype="auto")]),
                                        PolicyBefore()),
    "default-after": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(),
                                                                make_drafter("conditioned", target, compute_dtype="auto")]),
                                       AutoPolicy()),
    "conditioned-after": SpeculativeEngine(target, make_drafter("conditioned", target, compute_dtype="auto"), AutoPolicy()),
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
                          "target_passes_per_prompt": round(sum(r["target_passes"] for r in mine) / len(mine), 1),
                          "drafter_passes_per_prompt": round(sum(r["drafter_passes"] for r in mine) / len(mine), 1),
                          "off_share": round(sum(r["off_rounds"] for r in mine) / rounds, 4),
                          "hidden_state_share": round(sum(r["hidden_state_rounds"] for r in mine) / rounds, 4),
                          "all_equal_plain": all(r["equal_plain"] for r in mine)}
    print(ds, json.dumps(summary[ds]), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                   "rows": rows}, f, indent=1)
