"""A/B, interleaved: q8_linear.c's AVX2-or-native build at HEAD (/tmp/q8old) against the working tree's, on SmolLM2-135M's
Q4 shapes and its Q8 head (random GGUF codes), 2 threads; outputs compared bitwise.  python q4_accum_ab.py OUT.json"""
import json, sys, time
from pathlib import Path
import torch
from diffspec import packed_linear as pl, q8_linear as ql
from diffspec.machine_keys import machine_key
old = pl.compile_and_load(Path("/tmp/q8old/q8_linear.c"), "q8-linear-old", pl.NATIVE); ql.declare(old)
new = ql.build_library(pl.NATIVE)
print("isa", new.diffspec_q8_isa().decode(), old.diffspec_q8_isa().decode())
torch.manual_seed(0); torch.set_num_threads(2)
def q4_weight(n, k):
    q = torch.randint(0, 16, (n, k // 32, 32)).float(); q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1) * 0.01).half().float(); m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    return ((d * q) + m).reshape(n, k)
def q8_weight(n, k):
    q = torch.randint(-127, 128, (n, k // 32, 32)).float(); q[..., 0] = 127
    return ((torch.rand(n, k // 32, 1) * 0.001).half().float() * q).reshape(n, k)
shapes = [("q/k/v", q4_weight, 960, 576), ("o", q4_weight, 576, 576), ("gate/up", q4_weight, 3072, 576),
          ("down", q4_weight, 576, 1536), ("head", q8_weight, 49152, 576)]
rows_list = (1, 2, 4, 8, 16, 32)
out = {"machine": machine_key("cpu"), "rows": []}
for name, make, n, k in shapes:
    w = ql.Q8Weight.of(pl.pack(make(n, k)))
    for rows in rows_list:
        x = torch.randn(rows, k) * 3
        x[0, :7] = 1e4  # a block with one large value: codes at +-127
        a, b = ql.q8_linear(x, w, old), ql.q8_linear(x, w, new)
        same = bool(torch.equal(a, b))
        reps = max(3, int(3000 / (rows * n * k / 1e6)))
        best = {"old": 1e9, "new": 1e9}
        for turn in range(7):
            for tag, lib in (("old", old), ("new", new)) if turn % 2 == 0 else (("new", new), ("old", old)):
                ql.q8_linear(x, w, lib)
                t0 = time.perf_counter()
                for _ in range(reps): ql.q8_linear(x, w, lib)
                best[tag] = min(best[tag], (time.perf_counter() - t0) / reps * 1e6)
        row = dict(shape=name, n=n, k=k, rows=rows, old_us=round(best["old"], 1), new_us=round(best["new"], 1),
                   speedup=round(best["old"] / best["new"], 3), bitwise_equal=same)
        print(row, flush=True); out["rows"].append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
