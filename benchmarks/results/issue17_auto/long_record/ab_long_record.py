"""A/B, one process, interleaved: the `auto` policy's long record (a source whose drafts may be cut runs while
running it every round has paid over its last ~50 runs) against the rule before it, and prompt lookup with a history
of earlier requests under the new rule.

old rule: `AutoPolicy` whose sources report no long record (so only the short record and the "cheap" rule keep a
          source on: the policy before this change, bitwise).
Methods, prompt by prompt in a rotating order (benchmarks/interleaved_ab.py): plain; lookup-old / lookup-new (prompt
lookup alone); history-new (prompt lookup with `history_tokens=65536`); default-old / default-new (prompt lookup + the
shipped conditioned drafter, the default drafter); default-history-new (the same with the history). Each engine keeps
its own drafter, so a history holds only what that engine generated before, prompt by prompt in the order given; the
warm-up is a prompt outside the sets, and histories are cleared after it. Throughput ratio = total tokens / total time
against plain's in the same run; every output is checked against plain's.

    python ab_long_record.py [--sets humaneval mtbench champ] [--num-prompts 20] [--max-new-tokens 256]
                             [--kernels auto|q8] [--history-tokens 65536] [--json OUT]
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
from diffspec.policies.auto import _Source

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/interleaved_ab.py
from interleaved_ab import run_interleaved, summarize, write_json  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--kernels", default="auto")
ap.add_argument("--history-tokens", type=int, default=65536)
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads


class _NoLongRecord(_Source):
    long_efficiency = 0.0  # a class attribute over the property: the long record never keeps it on


class OldRule(AutoPolicy):
    def source(self, name):
        if name not in self.sources:
            self.sources[name] = _NoLongRecord(self.prior_efficiency, self.probe_first)
        return self.sources[name]


plain = load_engine(drafter="none", policy="fixed", backend="transformers", kernels=args.kernels, quiet=True)
target = plain.target
H = args.history_tokens
conditioned = lambda: make_drafter("conditioned", target, compute_dtype="auto")  # noqa: E731
engines = {
    "plain": plain,
    "lookup-old": SpeculativeEngine(target, PromptLookupDrafter(), OldRule()),
    "lookup-new": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy()),
    "history-new": SpeculativeEngine(target, PromptLookupDrafter(history_tokens=H), AutoPolicy()),
    "default-old": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(), conditioned()]), OldRule()),
    "default-new": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(), conditioned()]), AutoPolicy()),
    "default-history-new": SpeculativeEngine(
        target, CombinedDrafter([PromptLookupDrafter(history_tokens=H), conditioned()]), AutoPolicy()),
}
for m, e in engines.items():
    print(m, e.drafter.describe() if e.drafter else "-", e.policy.describe(), flush=True)


def clear_histories(engines):
    for e in engines.values():
        for part in (e.drafter.parts if e.drafter is not None else ()):
            if isinstance(part, PromptLookupDrafter):
                part.begin(None)
                part._history = part._new_index()


rows = run_interleaved(engines, prompts, args.max_new_tokens, warmup_text="Tell me a short joke about cats.",
                       after_warmup=clear_histories)
summary = summarize(rows, args.sets, list(engines))
if args.json:
    write_json(args.json, vars(args), summary, rows)
