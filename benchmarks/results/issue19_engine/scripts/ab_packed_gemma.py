"""ab_packed.py's comparison for Gemma 3 270M (Q4_K_M GGUF): only its Q8_0 tensors are codes the packed kernel
reads (the 262144 x 640 embedding, tied to the output head, and the v projections); its Q4_K/Q6_K layers keep
the float32 plan. A plain step and short verify passes at a 256-token context, eager, the packed plan against the
float32 plan measured in the same process with no layer packed, interleaved; min over 3 turns of the median of 5.

    python benchmarks/results/issue19_engine/scripts/ab_packed_gemma.py OUT.json
"""
import json
import sys

import torch

from diffspec import kernels as K
from diffspec.devices import host_info
from diffspec.greedy_head import GreedyHead
from diffspec.target import Target
from passes import float32_plan, greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
t = Target.load("gemma3-270m", quiet=False, kernels="auto")
packed = t.linear_plan
fp32, packed_layers = float32_plan(t)
linear_layers = sum(len(group) for group in K.linear_groups(t.model).values())
screen = GreedyHead.for_model(t.model)[0]
plans = {"fp32": fp32, "packed": packed}
print(f"{packed_layers} of {linear_layers} linear layers packed\npacked plan:", packed.describe(), "\nfp32 plan:", fp32.describe(), flush=True)
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256
res, agree = {}, {}
for k in (0, 1, 3, 7):
    row, picks = {}, {}
    for _ in range(3):
        for mode, plan in plans.items():
            K.uninstall(t.model)
            K.install(t.model, plan)
            t.linear_plan, t.greedy_head = plan, (screen if plan.head_rows else None)
            on_context(t, ids, ctx)
            ms, picks[mode] = median_pass_ms(t, ids, ctx, k, 5, read=greedy_choices)
            row.setdefault(mode, []).append(ms)
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    agree[k] = bool(torch.equal(picks["fp32"], picks["packed"]))
    print(f"k {k}: " + "  ".join(f"{m} {v:6.1f}" for m, v in res[k].items())
          + f"   fp32/packed x{res[k]['fp32'] / res[k]['packed']:.2f}  same greedy choices: {agree[k]}", flush=True)
if len(sys.argv) > 1:
    json.dump({"context": ctx, "ms": res, "same_greedy_choices": agree, "packed_layers": packed_layers,
               "linear_layers": linear_layers, "packed_plan": packed.describe(), "fp32_plan": fp32.describe(),
               "host": host_info()}, open(sys.argv[1], "w"), indent=1)
