"""Drafting through the direct Llama pass (llama_pass.py) against transformers' forward, the same drafter weights,
interleaved in one process.

Two drafter objects over one body: one runs its eager passes through `LlamaPass.forward` (what a drafter attached
to a target with measured kernels does now), the other through transformers' `model(...)` (its `_direct` unset).
They draft round by round along the target's own greedy answer (the context grows by `--step` tokens a round, as
in the engine when a couple of drafts are accepted), each keeping its own cache, the two timed in turn every round
after a warm-up. Every round's drafts must be the same tokens with the same q (the direct pass is bitwise the
model's own); the script stops with an error otherwise.

    python benchmarks/drafter_direct_pass_ab.py --kinds block-diffusion masked-diffusion --gammas 4 8 15 --out ab.json

The target loads with `--compile off` (the direct pass is the eager path; a compiled body is another column) and
the drafters as `make_drafter` builds them for it (SmolLM2: untrained 2-layer truncations of the target).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain why the sky is blue in three sentences.",
           "List the first ten prime numbers and say how you found them."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["block-diffusion", "masked-diffusion"])
    ap.add_argument("--gammas", nargs="+", type=int, default=[4, 8, 15])
    ap.add_argument("--tokens", type=int, default=96, help="answer tokens drafted along, per prompt")
    ap.add_argument("--step", type=int, default=2, help="context growth a round")
    ap.add_argument("--drafter-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from diffspec import SpeculativeEngine, Target, make_drafter
    from diffspec.policies import FixedPolicy
    from diffspec.types import SamplingParams

    target = Target.load(None, compile="off")
    answers = []
    for p in PROMPTS:
        ids = target.encode_prompt(p)
        out = SpeculativeEngine(target, None).generate(ids, max_new_tokens=args.tokens).token_ids
        answers.append((list(ids), list(out)))
    greedy = SamplingParams(temperature=0.0)
    results = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "target": target.describe() if hasattr(target, "describe") else "",
               "args": vars(args), "rows": []}
    for kind in args.kinds:
        pair = []
        for direct in (True, False):
            d = make_drafter(kind, target)
            if d.capabilities.chooses_dtype:
                d.compute_dtype = args.drafter_dtype
            d.attach(target)
            if not direct:
                d._direct = None
            elif d._direct is None:
                raise SystemExit(f"{kind}: the direct pass does not apply to its body here")
            pair.append(d)
        for gamma in args.gammas:
            times = {True: [], False: []}
            for prompt, answer in answers:
                for d in pair:
                    d.begin(None)
                for r, end in enumerate(range(0, len(answer) - gamma, args.step)):
                    context = torch.tensor(prompt + answer[:end])
                    drafts = []
                    order = pair if r % 2 == 0 else pair[::-1]
                    for d in order:
                        t = time.perf_counter()
                        draft = d.propose(context, FixedPolicy(gamma), gamma, greedy, None)
                        elapsed = time.perf_counter() - t
                        if r >= 2:  # warm-up rounds of each prompt not timed
                            times[d._direct is not None].append(elapsed)
                        drafts.append(draft.tokens.tolist())
                    if drafts[0] != drafts[1]:
                        raise SystemExit(f"{kind} gamma {gamma}: the two paths drafted {drafts[0]} and {drafts[1]}")
            row = {"kind": kind, "gamma": gamma, "rounds": len(times[True]),
                   "direct_ms_median": 1e3 * statistics.median(times[True]),
                   "transformers_ms_median": 1e3 * statistics.median(times[False]),
                   "direct_ms_total": 1e3 * sum(times[True]), "transformers_ms_total": 1e3 * sum(times[False])}
            row["speedup_median"] = row["transformers_ms_median"] / row["direct_ms_median"]
            row["speedup_total"] = row["transformers_ms_total"] / row["direct_ms_total"]
            results["rows"].append(row)
            print(f"{kind:16s} gamma {gamma:2d}: {row['rounds']} rounds, ms a round (median) direct "
                  f"{row['direct_ms_median']:.2f}, transformers {row['transformers_ms_median']:.2f} "
                  f"({row['speedup_median']:.2f}x; totals {row['speedup_total']:.2f}x); drafts identical", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
