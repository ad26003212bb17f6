"""GQA attention without the cache copy (attention.py) against transformers' repeat_kv route: one pass of
k + 1 rows (k = 0: a plain step) at a 256- and a 1024-token context, eager (--kernels auto), interleaved in
one process (the attention switched per pass); min over 5 turns of the median of 5; whether the logits
are bitwise equal. With --compiled: the same under --compile on (each attention route its own graph per
width, compiled on the first pass; k = 0, 3, 15), where the logits are compared to 1e-4.

    python benchmarks/results/issue19_engine/scripts/ab_gqa.py OUT.json [--compiled]
"""
import json
import sys

import torch

from diffspec import attention
from diffspec.target import Target
from passes import median_pass_ms, on_context

torch.set_num_threads(2)
compiled = "--compiled" in sys.argv
if compiled:
    import diffspec.compiled as C
    C.compile_widths = lambda target: None  # each width compiles on its first (warm-up) pass
t = Target.load(None, quiet=False, kernels="auto", compile="on" if compiled else "off")
assert t.model.config._attn_implementation == attention.GQA_SDPA
ids = torch.randint(0, t.vocab_size, (1200,), generator=torch.Generator().manual_seed(0))
TURNS = 5


def measure(ctx, k, gqa, reps=5):
    (attention.install if gqa else attention.uninstall)(t.model)
    on_context(t, ids, ctx, room=40)
    return median_pass_ms(t, ids, ctx, k, reps)


res = {}
for ctx in (256, 1024):
    for k in (0, 3, 15) if compiled else (0, 1, 3, 7, 15, 31):
        row, out = {"repeat_kv": [], "gqa": []}, {}
        for _ in range(TURNS):
            for name in row:
                ms, out[name] = measure(ctx, k, name == "gqa")
                row[name].append(ms)
        r = {name: round(min(v), 2) for name, v in row.items()}
        r["bitwise_equal"] = bool(torch.equal(out["gqa"], out["repeat_kv"]))
        r["max_logit_diff"] = float((out["gqa"] - out["repeat_kv"]).abs().max())
        res[f"{ctx}/{k}"] = r
        print(f"ctx {ctx:4d} k {k:2d}: repeat_kv {r['repeat_kv']:6.1f}  gqa {r['gqa']:6.1f}  "
              f"x{r['repeat_kv'] / r['gqa']:.3f}  bitwise equal {r['bitwise_equal']} (max diff {r['max_logit_diff']:.1e})", flush=True)
if len(sys.argv) > 1:
    json.dump({"ms": res, "compile": "on" if compiled else "off", "torch": torch.__version__,
               "compile_s": t.compiled.compile_s}, open(sys.argv[1], "w"), indent=1)
