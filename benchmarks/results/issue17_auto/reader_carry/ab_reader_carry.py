"""A/B, one process, interleaved: what carrying the shipped conditioned drafter costs the default (prompt lookup +
conditioned, auto policy) before and after this change, against prompt lookup alone.

before (`auto_before.py`, `combined_before.py`: the modules at 359f59d): a combined drafter with one part planned
        still values its lone draft (a length search a round); a retired reader live again probes up to probe_max.
after:  the lone draft passes through unweighed; a reader live again without having paid since is retired at its
        first lost probe; a reader whose calibration record says it loses on this machine starts off, as if retired
        once (the `_first` files: the run before this last part).
Methods, prompt by prompt in a rotating order (benchmarks/interleaved_ab.py): plain; lookup (prompt lookup alone, the
current policy); default-before; default-after. Throughput ratio = total tokens / total time against plain's in the
same run; every output is checked against plain's.

    python ab_reader_carry.py [--sets humaneval mtbench champ] [--num-prompts 20] [--max-new-tokens 256] [--json OUT]
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
sys.path[:0] = [str(HERE), str(HERE.parents[2])]  # the _before modules; benchmarks/interleaved_ab.py
from auto_before import AutoPolicy as AutoBefore  # noqa: E402
from combined_before import CombinedDrafter as CombinedBefore  # noqa: E402
from interleaved_ab import run_interleaved, summarize, write_json  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--json")
args = ap.parse_args()
prompts = [p for s in args.sets for p in load_bench_prompts(s, args.num_prompts)]  # before any model loads

plain = load_engine(drafter="none", policy="fixed", backend="transformers", quiet=True)
target = plain.target
conditioned = lambda: make_drafter("conditioned", target, compute_dtype="auto")  # noqa: E731
engines = {
    "plain": plain,
    "lookup": SpeculativeEngine(target, PromptLookupDrafter(), AutoPolicy()),
    "default-before": SpeculativeEngine(target, CombinedBefore([PromptLookupDrafter(), conditioned()]), AutoBefore()),
    "default-after": SpeculativeEngine(target, CombinedDrafter([PromptLookupDrafter(), conditioned()]), AutoPolicy()),
}
for m, e in engines.items():
    print(m, e.drafter.describe() if e.drafter else "-", e.policy.describe(), flush=True)
rows = run_interleaved(engines, prompts, args.max_new_tokens, warmup_text="Tell me a short joke about cats.")
summary = summarize(rows, args.sets, list(engines))
if args.json:
    write_json(args.json, vars(args), summary, rows)
