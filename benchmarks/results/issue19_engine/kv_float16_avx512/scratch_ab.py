"""In-process A/B (q8 target, float16 cache): "convert" = -DATTEND_HALF_SCRATCH=0 (every row of a pass converts the
float16 keys and values it reads), "scratch" = the default (a pass of several rows makes a key/value head float32
once per thread). Pass + greedy choice by rows at a context of real text; variants and rows interleaved, 25 of 30.
    python scratch_ab.py CONTEXT [CONTEXT ...]"""
import statistics, sys, time, torch
from diffspec import fused_layers as FL
from diffspec.packed_linear import NATIVE
from diffspec.api import load_engine
from diffspec.datasets import load_prompts

variants = {"convert": NATIVE + ("-DATTEND_HALF_SCRATCH=0",), "scratch": NATIVE}
libs = {k: FL.build_library(f) for k, f in variants.items()}
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
t = e.target; fl = t.direct_pass.fused
text = " ".join(p for _, p in load_prompts("humaneval")[:30])
ids = torch.tensor(t.encode_prompt(text, chat=False)[:2100])
rows = (1, 2, 3, 5, 8)
for ctx in [int(c) for c in sys.argv[1:]]:
    t.reset(); t.prefill(ids[:ctx], ctx + 64)
    res, same = {}, True
    for rep in range(30):
        for n in rows:
            got = {}
            for k in (list(variants) if rep % 2 else list(variants)[::-1]):
                fl.lib = libs[k]
                t0 = time.perf_counter(); got[k] = t.forward(ids[ctx:ctx + n]).greedy_tokens(); dt = time.perf_counter() - t0
                t.truncate(ctx)
                if rep >= 5: res.setdefault((n, k), []).append(dt * 1e3)
            same &= torch.equal(got["convert"], got["scratch"])
    print(f"context {ctx}: " + "  ".join(
        f"n{n} {statistics.median(res[(n, 'convert')]):.3f}->{statistics.median(res[(n, 'scratch')]):.3f} "
        f"({statistics.median(res[(n, 'scratch')]) / statistics.median(res[(n, 'convert')]):.3f})" for n in rows)
        + f"  same greedy tokens: {same}", flush=True)
