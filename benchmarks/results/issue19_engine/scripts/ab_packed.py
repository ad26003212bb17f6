"""The packed GGUF-code kernel (packed_linear.py) against the float32 kernels it displaces: one verify pass over
k drafted tokens (k = 0: a plain decoding step) at a 256-token context, eager, in one process, interleaved per
turn: "before" (transformers' concatenating DynamicCache, F.linear: before issue 19), "fp32" (`--kernels auto`
as it was: the plan measured with no layer packed, its greedy-head screen included) and "packed" (`--kernels auto`
now). Each pass's greedy choices are read. Median of 5 passes per turn, min over 3 turns. Also whether each
plan's greedy choices agree at every k.

    python benchmarks/results/issue19_engine/scripts/ab_packed.py OUT.json
"""
import json
import sys

import torch
from transformers import DynamicCache

from diffspec import kernels as K
from diffspec.devices import host_info
from diffspec.greedy_head import GreedyHead
from diffspec.target import Target
from passes import float32_plan, greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
t = Target.load(None, quiet=False, kernels="auto")
packed = t.linear_plan
fp32, _ = float32_plan(t)  # the plan as it was: no layer packed
screen = GreedyHead.for_model(t.model)[0]
plans = {"before": K.LinearPlan(), "fp32": fp32, "packed": packed}
print("packed plan:", packed.describe(), "\nfp32 plan:", fp32.describe(), flush=True)
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256

res, agree = {}, {}
for k in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
    row, picks = {}, {}
    for _ in range(3):
        for mode, plan in plans.items():
            K.uninstall(t.model)
            K.install(t.model, plan)
            t.linear_plan, t.greedy_head = plan, (screen if plan.head_rows else None)
            on_context(t, ids, ctx, cache=DynamicCache(config=t.model.config) if mode == "before" else None)
            ms, picks[mode] = median_pass_ms(t, ids, ctx, k, 5, read=greedy_choices)
            row.setdefault(mode, []).append(ms)
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    agree[k] = {m: bool(torch.equal(picks[m], picks["before"])) for m in plans}
    print(f"k {k:2d}: " + "  ".join(f"{m} {v:6.1f}" for m, v in res[k].items())
          + f"   fp32/packed x{res[k]['fp32'] / res[k]['packed']:.2f}  before/packed x{res[k]['before'] / res[k]['packed']:.2f}"
          + f"  same choices as before: {agree[k]}", flush=True)
if len(sys.argv) > 1:
    json.dump({"context": ctx, "ms": res, "same_greedy_choices_as_before": agree, "packed_plan": packed.describe(),
               "fp32_plan": fp32.describe(), "packed_timings_us": packed.timings_us, "fp32_timings_us": fp32.timings_us,
               "host": host_info()}, open(sys.argv[1], "w"), indent=1)
