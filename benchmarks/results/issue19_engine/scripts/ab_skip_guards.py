"""Compiled passes with and without dynamo's guards evaluated on every call (compiled.CompiledPasses.run),
interleaved in one process: one pass over k drafted tokens at a 256-token context (k = 0: a plain step),
greedy choices read, median of 9 passes per turn, min over 4 turns; the choices must be the same.

    python benchmarks/results/issue19_engine/scripts/ab_skip_guards.py OUT.json [--compile on|auto]
"""
import argparse
import json
import subprocess

import torch

import diffspec.compiled as C
from diffspec.target import Target
from passes import greedy_choices, median_pass_ms, on_context

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--compile", default="on")
ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7, 15])
args = ap.parse_args()
torch.set_num_threads(2)
t = Target.load(None, quiet=False, kernels="auto", compile=args.compile)
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256


def measure(k, skip, reps=9):
    C.SKIP_STEADY_GUARDS = skip
    t.compiled.guarded.clear()
    on_context(t, ids, ctx, room=40)
    return median_pass_ms(t, ids, ctx, k, reps, read=greedy_choices)


res = {}
for k in args.ks:
    row, choices = {}, {}
    for _ in range(4):
        for mode in ("guards every call", "guards once per key"):
            ms, choices[mode] = measure(k, mode != "guards every call")
            row.setdefault(mode, []).append(ms)
    assert torch.equal(*choices.values())
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    a, b = res[k].values()
    print(f"k {k:2d}: guards every call {a:6.2f}  once per key {b:6.2f}  x{a / b:.3f}", flush=True)
flags = subprocess.run("grep -o -w -E 'amx_bf16|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort -u",
                       shell=True, capture_output=True, text=True).stdout.split()
json.dump({"context": ctx, "compile": args.compile, "runtime": t.runtime()["compile"], "ms": res, "cpu_flags": flags,
           "torch": torch.__version__}, open(args.out, "w"), indent=1)
