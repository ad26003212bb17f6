"""Verify cost with bucketed compiled widths: one verify pass over k drafted tokens (k = 0: a plain
decoding step) at a 256-token context, in one process, interleaved: `before` (transformers'
concatenating DynamicCache, F.linear: the code before issue 19), `eager` (--kernels auto --compile off)
and `compiled` (--compile on: a pass of k + 1 rows runs the graph of the smallest width in
compiled.WIDTH_BUCKETS that holds it, padded; each bucket compiled on its first pass, which the
warm-up absorbs; compile seconds reported). Median of 5 passes per turn, min over 5 turns; the
largest logit difference compiled vs eager per k.

    python benchmarks/results/issue19_engine/scripts/ab4.py OUT.json [k ...]
"""
import json
import sys
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from diffspec import kernels as K
from diffspec.target import Target
from passes import median_pass_ms, on_context

torch.set_num_threads(2)
import diffspec.compiled as C
C.compile_widths = lambda target: None  # buckets compile on their first (warm-up) pass
t = Target.load(None, quiet=False, kernels="auto", compile="on")
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256
TURNS = 5


def measure(k, mode, reps=5):
    on_context(t, ids, ctx, cache=DynamicCache(config=t.model.config) if mode == "before" else None)
    t.compiled.shapes = None if mode == "compiled" else set()
    return median_pass_ms(t, ids, ctx, k, reps, each=(lambda: K.stock_kernels(t.model)) if mode == "before"
                          else nullcontext)


res = {}
for k in [int(a) for a in sys.argv[2:]] or (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 20, 23, 24, 28, 31):
    row, out = {}, {}
    for _ in range(TURNS):
        for mode in ("before", "eager", "compiled"):
            ms, out[mode] = measure(k, mode)
            row.setdefault(mode, []).append(ms)
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    res[k]["graph_rows"] = C.bucket(k + 1)
    res[k]["max_logit_diff_compiled_vs_eager"] = float((out["compiled"] - out["eager"]).abs().max())
    print(f"k {k:2d} (graph {res[k]['graph_rows']}): " + "  ".join(f"{m} {res[k][m]:6.1f}" for m in row)
          + f"   before/eager x{res[k]['before'] / res[k]['eager']:.2f}  before/compiled "
            f"x{res[k]['before'] / res[k]['compiled']:.2f}  diff {res[k]['max_logit_diff_compiled_vs_eager']:.1e}",
          flush=True)
if len(sys.argv) > 1:
    json.dump({"context": ctx, "width_buckets": C.WIDTH_BUCKETS, "ms": res, "auto_plan": t.linear_plan.describe(),
               "compile_s": t.compiled.compile_s}, open(sys.argv[1], "w"), indent=1)
