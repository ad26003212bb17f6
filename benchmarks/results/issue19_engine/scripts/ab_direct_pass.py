"""The target's eager pass before issue 19 (transformers' concatenating DynamicCache, F.linear, transformers'
attention), through transformers' forward with --kernels auto (packed GGUF codes), and through the direct Llama
pass (llama_pass.py) with the same kernels, in one process, interleaved: a pass of k + 1 rows at a 256-token
context, its greedy choices read as the engine reads them; median of 7 passes per turn, min and median over 7
turns; the last two passes' logits compared bitwise at every k, and all three passes' greedy choices.

    python benchmarks/results/issue19_engine/scripts/ab_direct_pass.py OUT.json [k ...]
"""
import json
import statistics
import sys

from contextlib import nullcontext

import torch
from transformers import DynamicCache

from diffspec import kernels as K
from diffspec.target import Target
from passes import greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
t = Target.load(None, quiet=True, kernels="auto")
direct = t.direct_pass
assert direct is not None, t.runtime()
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ks = [int(a) for a in sys.argv[2:]] or [0, 1, 2, 3, 4, 5, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32]
MODES = ("before", "transformers", "direct")


def measure(mode, k, reps):
    t.direct_pass = direct if mode == "direct" else None
    on_context(t, ids, 256, cache=DynamicCache(config=t.model.config) if mode == "before" else None)
    each = (lambda: K.stock_kernels(t.model)) if mode == "before" else nullcontext
    return median_pass_ms(t, ids, 256, k, reps, each=each, read=greedy_choices)


res = {}
for k in ks:
    row, logits = {}, {}
    for name in ("transformers", "direct"):
        t.direct_pass = direct if name == "direct" else None
        on_context(t, ids, 256)
        logits[name] = t.forward(ids[256:257 + k]).logits
    choices = {m: measure(m, k, 1)[1] for m in MODES}
    for _ in range(7):
        for mode in MODES:
            row.setdefault(mode, []).append(measure(mode, k, 7)[0])
    res[k] = {n: {"min_ms": round(min(v), 2), "median_ms": round(statistics.median(v), 2)} for n, v in row.items()}
    res[k]["logits_bitwise_equal"] = bool(torch.equal(logits["transformers"].view(torch.int32),
                                                      logits["direct"].view(torch.int32)))
    res[k]["greedy_choices_equal"] = all(torch.equal(choices[m], choices["direct"]) for m in MODES)
    b, a, d = (res[k][m]["min_ms"] for m in MODES)
    print(f"k {k:2d}: before {b:6.2f}  transformers {a:6.2f}  direct {d:6.2f}  before/direct x{b / d:.2f}  "
          f"transformers/direct x{a / d:.2f}  bitwise {res[k]['logits_bitwise_equal']}  "
          f"choices {res[k]['greedy_choices_equal']}", flush=True)
t.direct_pass = direct
if len(sys.argv) > 1:
    json.dump({"context": 256, "runtime": t.runtime(), "ms": res}, open(sys.argv[1], "w"), indent=1)
