"""Inductor's inference options on the compiled verify pass (issue 19, item 3: "try what inductor offers
for inference: weight freezing/prepacking, max-autotune, the C++ wrapper; oneDNN/mkldnn prepacked
linears; keep what measures faster"). One process per variant; in it, one verify pass over k drafted
tokens at a 256-token context, interleaved: `eager` (--kernels auto --compile off, the reference every
variant is divided by) and `compiled` (the variant's graph of the bucket that holds k + 1 rows, padded,
as Target runs it; compiled on its first pass, which the warm-up absorbs). Median of 5 passes per turn,
min over 5 turns; compile seconds per width; the largest logit difference compiled vs eager.

Variants (torch.compile options; `-stock`: the graph traced with F.linear everywhere, the form inductor's
freezing passes pack into mkldnn/MKL linears; otherwise the measured --kernels auto plan is traced in):
    default, freezing, freezing-stock, cpp-wrapper, freezing-cpp-wrapper, max-autotune, max-autotune-stock

    python benchmarks/results/issue19_engine/scripts/ab5.py VARIANT OUT.json [k ...]
"""
import contextlib
import json
import sys

import torch

from diffspec import kernels as K
import diffspec.compiled as C
from diffspec.target import Target
from passes import median_pass_ms, on_context

torch.set_num_threads(2)
VARIANTS = {
    "default": {},
    "freezing": {"freezing": True},
    "freezing-stock": {"freezing": True},
    "cpp-wrapper": {"cpp_wrapper": True},
    "freezing-cpp-wrapper": {"freezing": True, "cpp_wrapper": True},
    "max-autotune": {"max_autotune": True},
    "max-autotune-stock": {"max_autotune": True},
}
variant = sys.argv[1]
options = VARIANTS[variant]
C.compile_widths = lambda target: None  # buckets compile on their first (warm-up) pass
t = Target.load(None, quiet=False, kernels="auto", compile="on")
t.compiled.fn = torch.compile(t.model.forward, dynamic=True, options=options or None)
stock = variant.endswith("-stock")
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256
TURNS = 5


def measure(k, mode, reps=5):
    on_context(t, ids, ctx)
    t.compiled.shapes = None if mode == "compiled" else set()
    with K.stock_kernels(t.model) if stock and mode == "compiled" else contextlib.nullcontext():
        return median_pass_ms(t, ids, ctx, k, reps)


res = {}
for k in [int(a) for a in sys.argv[3:]] or (0, 1, 3, 7, 15, 23, 31):
    row, out = {}, {}
    for _ in range(TURNS):
        for mode in ("eager", "compiled"):
            ms, out[mode] = measure(k, mode)
            row.setdefault(mode, []).append(ms)
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    res[k]["graph_rows"] = C.bucket(k + 1)
    res[k]["eager_over_compiled"] = round(res[k]["eager"] / res[k]["compiled"], 3)
    res[k]["max_logit_diff_compiled_vs_eager"] = float((out["compiled"] - out["eager"]).abs().max())
    print(f"{variant} k {k:2d} (graph {res[k]['graph_rows']}): eager {res[k]['eager']:6.1f}  compiled "
          f"{res[k]['compiled']:6.1f}  eager/compiled x{res[k]['eager_over_compiled']:.2f}  "
          f"diff {res[k]['max_logit_diff_compiled_vs_eager']:.1e}", flush=True)
json.dump({"variant": variant, "options": options, "traced_kernels": "stock" if stock else "auto", "context": ctx,
           "width_buckets": C.WIDTH_BUCKETS, "ms": res, "auto_plan": t.linear_plan.describe(),
           "compile_s": t.compiled.compile_s, "torch": torch.__version__},
          open(sys.argv[2], "w"), indent=1)
