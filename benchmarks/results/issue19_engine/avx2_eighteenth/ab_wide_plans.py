"""Wide verify passes under the two float32 kernel plans, interleaved in one process: `--kernels auto` (the GGUF
codes' packed kernel wherever it won its matmul timed alone; every layer packed at a width -> the fused C call) and
`--kernels multi-row` (MKL's float32 GEMM on the dequantized weights). A pass of k + 1 rows at a 256-token context,
its greedy choices read as the engine reads them; median of 5 passes a turn, the two plans alternating k by k, min
and median over the turns.

    python benchmarks/results/issue19_engine/avx2_eighteenth/ab_wide_plans.py OUT.json [k ...]
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from passes import greedy_choices, median_pass_ms, on_context  # noqa: E402

from diffspec.target import Target  # noqa: E402

torch.set_num_threads(2)
targets = {k: Target.load(None, quiet=True, kernels=k) for k in ("auto", "multi-row")}
ids = torch.randint(0, targets["auto"].vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ks = [int(a) for a in sys.argv[2:]] or [4, 8, 11, 15, 23, 31, 47, 63]
CTX, TURNS = 256, 5
for t in targets.values():
    on_context(t, ids, CTX)
ms = {name: {k: [] for k in ks} for name in targets}
same = {k: True for k in ks}
for turn in range(TURNS):
    for k in ks:
        order = list(targets.items()) if turn % 2 == 0 else list(targets.items())[::-1]
        chosen = {}
        for name, t in order:
            m, last = median_pass_ms(t, ids, CTX, k, reps=5, read=greedy_choices)
            ms[name][k].append(m)
            chosen[name] = last.tolist() if hasattr(last, "tolist") else last
        same[k] = same[k] and chosen["auto"] == chosen["multi-row"]
rows = []
for k in ks:
    a, b = ms["auto"][k], ms["multi-row"][k]
    rows.append({"k": k, "rows": k + 1, "auto_min": min(a), "auto_median": statistics.median(a),
                 "multi_row_min": min(b), "multi_row_median": statistics.median(b),
                 "auto_over_multi_row_median": statistics.median(a) / statistics.median(b),
                 "greedy_choices_equal": same[k]})
    print(f"k {k:2d}: auto {min(a):7.1f} / {statistics.median(a):7.1f} ms, multi-row {min(b):7.1f} / "
          f"{statistics.median(b):7.1f} ms (min / median); auto/multi-row {rows[-1]['auto_over_multi_row_median']:.2f}; "
          f"greedy choices equal: {same[k]}", flush=True)
json.dump({"plans": {n: t.runtime() for n, t in targets.items()}, "context": CTX, "turns": TURNS, "rows": rows},
          open(sys.argv[1], "w"), indent=1, default=str)
