"""A/B, one process, interleaved: the shipped conditioned drafter's draft round with its context keys/values
kept in the model's dtype (bf16 here: attention's second bmm in bf16, which oneDNN compiles anew for every
context length) against float32 (conditioned_pass.cache_dtype: MKL's float32 bmm).

    python benchmarks/results/issue16_training/drafter_round/ab_cache_dtype.py [--contexts 100 300 1000]
        [--accepted 2] [--turns 7] [--steps 40] [--json OUT]

A round = observe 1 + accepted positions' features, then block_logits (as the engine calls it). Random
features and tokens (the cost does not depend on their values). The context grows by `accepted` every round,
as in generation. oneDNN caches the kernels it builds by shape, so the lengths matter: `--lengths fresh` (the
default) gives each (turn, variant) its own range of context lengths, never seen before in the process (a
one-shot `diffspec generate`, or a server's first requests); `--lengths repeated` runs every turn over the same
lengths (a warm server whose requests have passed them all). Prints min and median over turns of each turn's
median round (ms), and how far the two variants' logits differ on the same round.
"""
import argparse
import json
import statistics
import time

import torch

import diffspec.drafters.conditioned as C
import diffspec.drafters.conditioned_pass as CP
from diffspec.api import load_engine

ap = argparse.ArgumentParser()
ap.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1000])
ap.add_argument("--accepted", type=int, default=2)
ap.add_argument("--turns", type=int, default=7)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--lengths", choices=["fresh", "repeated"], default="fresh")
ap.add_argument("--json")
args = ap.parse_args()

drafter = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True).drafter
model = drafter.model
dtype = next(model.parameters()).dtype
print(drafter.describe(), "| torch threads", torch.get_num_threads())
g = torch.Generator().manual_seed(0)
span = args.accepted * (args.steps + 1)
total = max(args.contexts) + span * (2 * args.turns + 1) + 1
features = torch.randn(total, model.fc.in_features, generator=g).to(dtype)
tokens = torch.randint(0, 1000, (total,), generator=g)
new_dtype = CP.cache_dtype
variants = {"model dtype": lambda d: d, "float32": new_dtype}


def use(variant):
    CP.cache_dtype = C.cache_dtype = variants[variant]


def round_(m):
    n = drafter._context_len
    drafter.observe(features[n:n + m], n)
    return drafter.block_logits(tokens[:n + m + 1])


rows = []
with torch.inference_mode():
    for n0 in args.contexts:
        times = {v: [] for v in variants}
        for turn in range(args.turns):
            for i, v in enumerate(variants):
                use(v)
                start = n0 + (span * (2 * turn + i) if args.lengths == "fresh" else 0)
                drafter.begin(None)
                drafter.observe(features[:start], 0)
                drafter._flush()
                ts = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    round_(args.accepted)
                    ts.append((time.perf_counter() - t) * 1e3)
                times[v].append(statistics.median(ts[5:]))
        logits = {}
        for v in variants:
            use(v)
            drafter.begin(None)
            drafter.observe(features[:n0], 0)
            logits[v] = round_(1).float()
        a, b = logits.values()
        row = {"context": n0, "lengths": args.lengths, "cache": {v: str(variants[v](dtype)) for v in variants},
               **{f"{v}_min_ms": round(min(t), 3) for v, t in times.items()},
               **{f"{v}_median_ms": round(statistics.median(t), 3) for v, t in times.items()},
               "max_abs_logit_diff": round(float((a - b).abs().max()), 4),
               "argmax_agree": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 3)}
        row["speedup_median"] = round(row["model dtype_median_ms"] / row["float32_median_ms"], 2)
        rows.append(row)
        print(json.dumps(row))
use("float32")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"drafter": drafter.describe(), "args": vars(args), "rows": rows}, f, indent=1)
