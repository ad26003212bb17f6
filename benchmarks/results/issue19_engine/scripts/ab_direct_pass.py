"""The target's eager pass through transformers' forward against the direct Llama pass (llama_pass.py), on the
default target (--kernels auto: packed GGUF codes), in one process, interleaved: a pass of k + 1 rows at a
256-token context, its greedy choices read as the engine reads them; median of 7 passes per turn, min and median
over 7 turns; the two passes' logits compared bitwise at every k.

    python benchmarks/results/issue19_engine/scripts/ab_direct_pass.py OUT.json [k ...]
"""
import json
import statistics
import sys

import torch

from diffspec.target import Target
from passes import greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
t = Target.load(None, quiet=True, kernels="auto")
direct = t.direct_pass
assert direct is not None, t.runtime()
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ks = [int(a) for a in sys.argv[2:]] or [0, 1, 2, 3, 4, 5, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32]
res = {}
for k in ks:
    row, logits = {}, {}
    for name, p in (("transformers", None), ("direct", direct)):
        t.direct_pass = p
        on_context(t, ids, 256)
        logits[name] = t.forward(ids[256:257 + k]).logits
    for _ in range(7):
        for name, p in (("transformers", None), ("direct", direct)):
            t.direct_pass = p
            on_context(t, ids, 256)
            row.setdefault(name, []).append(median_pass_ms(t, ids, 256, k, 7, read=greedy_choices)[0])
    res[k] = {n: {"min_ms": round(min(v), 2), "median_ms": round(statistics.median(v), 2)} for n, v in row.items()}
    res[k]["logits_bitwise_equal"] = bool(torch.equal(logits["transformers"].view(torch.int32),
                                                      logits["direct"].view(torch.int32)))
    a, b = res[k]["transformers"]["min_ms"], res[k]["direct"]["min_ms"]
    print(f"k {k:2d}: transformers {a:6.2f}  direct {b:6.2f}  x{a / b:.2f}  bitwise {res[k]['logits_bitwise_equal']}",
          flush=True)
t.direct_pass = direct
if len(sys.argv) > 1:
    json.dump({"context": 256, "runtime": t.runtime(), "ms": res}, open(sys.argv[1], "w"), indent=1)
