"""In-process A/B of q8_linear.c's prefetch (off: -DQ8_PREFETCH=0; nta8: the default) on the pass + greedy choice at
256 positions of context, by rows; variants and row counts interleaved, 25 timed of 30."""
import json, statistics, time, torch
from diffspec import fused_layers as FL, q8_linear as Q
from diffspec.packed_linear import NATIVE
from diffspec.api import load_engine
variants = {"off": NATIVE + ("-DQ8_PREFETCH=0",), "nta8": NATIVE}
libs = {k: (FL.build_library(f), Q.build_library(f)) for k, f in variants.items()}
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
t = e.target; fl = t.direct_pass.fused
def use(k):
    fl.lib = libs[k][0]
    Q.library = lambda isa_flags=NATIVE, _l=libs[k][1]: _l
ids = torch.randint(100, 20000, (300,), generator=torch.Generator().manual_seed(0))
t.prefill(ids[:256], 300)
L, res = 256, {}
for rep in range(30):
    for n in (1, 2, 3, 4, 8, 16, 32):
        for k in (variants if rep % 2 else list(variants)[::-1]):
            use(k)
            t0 = time.perf_counter(); t.forward(ids[L:L + n]).greedy_tokens(); dt = time.perf_counter() - t0
            t.truncate(L)
            if rep >= 5: res.setdefault((n, k), []).append(dt * 1e3)
for n in (1, 2, 3, 4, 8, 16, 32):
    a, b = statistics.median(res[(n, "off")]), statistics.median(res[(n, "nta8")])
    print(f"rows {n:2d}: off {a:.3f} ms  nta8 {b:.3f} ms  nta8/off {b / a:.3f}")
