"""A/B, one process, interleaved: prompt lookup before and after this change, on one shared target.

before (`prompt_lookup_before.py`, the drafter at 9bf06d4): the latest earlier occurrence of the longest suffix
        n-gram (3, else 2) is copied; its confidence is the request's acceptance rate of copies from n-gram matches
        of that n (prior n / 3). It runs under this session's policy code (the same for both sides: the cheaper
        length arithmetic and the shared empty draft), so the A/B isolates the drafter.
after:  of the latest 16 occurrences of that n-gram, the one whose match reaches furthest back (up to 64 tokens) is
        copied; confidence per match-length class (2, 3, 4-7, 8-15, 16-31, 32+; prior m / (m + 2)).

The loop is benchmarks/interleaved_ab.py (the runs recorded here ran the same loop written inline). Methods, prompt by
prompt in a rotating order: plain; lookup-before / lookup-after (prompt lookup alone, auto
policy); default-before / default-after (prompt lookup + the shipped conditioned drafter, auto policy: the default
drafter on the transformers backend). Throughput ratio = total tokens / total time against plain's in the same run;
every output is checked against plain's.

    python ab_longest_match.py [--sets humaneval mtbench champ] [--num-prompts 20] [--max-new-tokens 256]
                               [--kernels auto|q8] [--json OUT]
"""
import argparse
import sys
from pathlib import Path

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafter_names import make_drafter
from diffspec.drafters import CombinedDrafter
from diffspec.drafters.prompt_lookup import PromptLookupDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]  # prompt_lookup_before.py; benchmarks/interleaved_ab.py
from interleaved_ab import run_interleaved, summarize, write_json  # noqa: E402
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
rows = run_interleaved(engines, prompts, args.max_new_tokens)
summary = summarize(rows, args.sets, list(engines))
if args.json:
    write_json(args.json, vars(args), summary, rows)
