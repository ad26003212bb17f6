"""One verify pass over k drafted tokens (k = 0: a plain decoding step) at a 256-token context, the
transformers target under three kernel plans in one process, interleaved (stock, multi-row, auto, x3),
median of 5 passes per turn, min over the 3 turns. Each pass's greedy choices are read, as the engine
reads them (since TargetOutput computes logits lazily, a pass whose output nobody reads skips the head:
this script's JSONs from before that change timed full logits, the same work). "auto" screens the head
where its plan says so; the others compute it in fp32. Also the same on transformers' concatenating
DynamicCache with stock kernels ("before", the cache issue 19 replaced).

    python benchmarks/results/issue19_engine/scripts/ab2.py OUT.json
"""
import json
import sys

import torch
from transformers import DynamicCache

from diffspec import kernels as K
from diffspec.target import Target
from passes import greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
t = Target.load(None, quiet=False, kernels="auto")
auto = t.linear_plan
screen = t.greedy_head
plans = {"stock": K.LinearPlan(), "multi-row": auto.multi_row_only(), "auto": auto}
print("auto plan:", auto.describe(), flush=True)
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256


def measure(k, reps=5, dynamic=False):
    on_context(t, ids, ctx, cache=DynamicCache(config=t.model.config) if dynamic else None)
    return median_pass_ms(t, ids, ctx, k, reps, read=greedy_choices)[0]


res = {}
for k in (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
    row = {}
    for _ in range(3):
        for mode in ("before", "stock", "multi-row", "auto"):
            K.uninstall(t.model)
            K.install(t.model, plans.get(mode, plans["stock"]))
            t.linear_plan, t.greedy_head = plans.get(mode, plans["stock"]), screen if mode == "auto" else None
            row.setdefault(mode, []).append(measure(k, dynamic=mode == "before"))
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    print(f"k {k:2d}: " + "  ".join(f"{m} {v:6.1f}" for m, v in res[k].items())
          + f"   before/auto x{res[k]['before'] / res[k]['auto']:.2f}", flush=True)
if len(sys.argv) > 1:
    json.dump({"context": ctx, "ms": res, "auto_plan": auto.describe()}, open(sys.argv[1], "w"), indent=1)
