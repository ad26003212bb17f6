"""A/B, one process, interleaved, at temperature > 0: prompt lookup kept on by the `auto` policy's "cheap" rule when
sampling too (its drafts are verified as one-hot q, so the policy may cut them: "after"), against the rule for greedy
rounds only ("before": when sampling, its record decides, and rounds without a copy switch it off).

Methods, in a rotating order per prompt, each with the same seed per prompt: plain; lookup-before; lookup-after
(prompt lookup alone, auto policy). Sampled outputs differ between methods (the draws are consumed differently), so
the ratio is total tokens / total time; the distribution is the target's by the tests (tests/test_auto_policy.py,
the chi-square test of auto + prompt lookup when sampling).

    python ab_sampling.py [--sets humaneval mtbench champ] [--num-prompts 10] [--max-new-tokens 256]
                          [--temperature 0.7] [--json OUT]
"""
import argparse
import json
import platform
import time

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafters.prompt_lookup import PromptLookupDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy
from diffspec.types import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=10)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--temperature", type=float, default=0.7)
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads


class PolicyBefore(AutoPolicy):
    def attach(self, target, drafter, engine_type=None):
        super().attach(target, drafter, engine_type)
        for src in self.sources.values():
            src.one_hot = False  # the rule for greedy rounds only


plain = load_engine(drafter="none", policy="fixed", backend="transformers", quiet=True)
target = plain.target
engines = {"plain": plain,
           "lookup-before": SpeculativeEngine(target, PromptLookupDrafter(), PolicyBefore()),
           "lookup-after": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy())}
for e in engines.values():
    e.generate(prompts[0].text, max_new_tokens=32, sampling=SamplingParams(temperature=args.temperature, seed=0))

rows, names = [], list(engines)
for i, p in enumerate(prompts):
    order = names[i % len(names):] + names[:i % len(names)]
    for m in order:
        sampling = SamplingParams(temperature=args.temperature, seed=1000 + i)
        t0 = time.perf_counter()
        r = engines[m].generate(p.text, max_new_tokens=args.max_new_tokens, sampling=sampling)
        wall = time.perf_counter() - t0
        rows.append({"method": m, "dataset": p.dataset, "prompt_id": p.prompt_id, "wall_s": wall,
                     "tokens": len(r.token_ids), "rounds": r.num_rounds, "target_passes": r.target_forward_passes,
                     "off_rounds": r.speculation_off_rounds, "drafted": r.drafted_tokens, "accepted": r.accepted_tokens})
    print(i, p.dataset, " ".join(f"{r['method']}:{r['wall_s']:.2f}/{r['tokens']}/{r['target_passes']}"
                                 for r in rows[-len(names):]), flush=True)

summary = {}
for ds in args.sets + ["all"]:
    sel = [r for r in rows if ds == "all" or r["dataset"] == ds]
    rate = {m: sum(r["tokens"] for r in sel if r["method"] == m) / sum(r["wall_s"] for r in sel if r["method"] == m)
            for m in names}
    summary[ds] = {m: {"tok_s": round(rate[m], 2), "ratio": round(rate[m] / rate["plain"], 4),
                       "tokens_per_round": round(sum(r["tokens"] for r in sel if r["method"] == m)
                                                 / sum(r["rounds"] for r in sel if r["method"] == m), 3),
                       "off_share": round(sum(r["off_rounds"] for r in sel if r["method"] == m)
                                          / sum(r["rounds"] for r in sel if r["method"] == m), 4),
                       "accepted_per_drafted": round(sum(r["accepted"] for r in sel if r["method"] == m)
                                                     / max(1, sum(r["drafted"] for r in sel if r["method"] == m)), 4)}
                   for m in names}
    print(ds, json.dumps(summary[ds]), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                   "rows": rows}, f, indent=1)
