import sys, time, torch
sys.path.insert(0, "/work/main/tests")
from pathlib import Path
from diffspec import q8_linear as Q, packed_linear as P
from diffspec.packed_linear import compile_and_load, NATIVE
from test_packed_linear import gguf_weight
old = Q.library()
new = compile_and_load(Path(sys.argv[1]), "q8x-" + Path(sys.argv[1]).stem, NATIVE); Q.declare(new)
# bitwise on odd shapes and all row counts
for kind in ("q4_1", "q8_0"):
    for k in (32, 96, 480, 512, 544, 576, 992, 1536):
        w = Q.Q8Weight.of(P.pack(gguf_weight(kind, 37, k, seed=k)))
        x = torch.randn(19, k, generator=torch.Generator().manual_seed(k)) * 3
        for r in (1, 2, 3, 4, 5, 8, 9, 16, 19):
            a, b = Q.q8_linear(x[:r], w, old), Q.q8_linear(x[:r], w, new)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (kind, k, r)
print("bitwise equal on every shape and row count")
def t(lib, x, w, reps=30):
    t0 = time.perf_counter()
    for _ in range(reps): Q.q8_linear(x, w, lib)
    return (time.perf_counter() - t0) / reps
tot = {}
for kind, K, N in (("q8_0", 576, 960), ("q4_1", 576, 960), ("q8_0", 576, 3072), ("q4_1", 576, 3072), ("q8_0", 1536, 576), ("q4_1", 1536, 576)):
    w = Q.Q8Weight.of(P.pack(gguf_weight(kind, N, K, seed=1)))
    for R in (1, 3, 8, 16, 64):
        x = torch.randn(R, K)
        to, tn = [], []
        for _ in range(9):
            to.append(t(old, x, w)); tn.append(t(new, x, w))
        to, tn = sorted(to)[4], sorted(tn)[4]
        tot.setdefault(R, [0, 0]); tot[R][0] += to; tot[R][1] += tn
        print(f"{kind} K={K:4d} N={N:4d} R={R:2d}: old {to*1e3:.4f} new {tn*1e3:.4f} ms  new/old {tn/to:.3f}", flush=True)
print({R: round(v[1] / v[0], 3) for R, v in tot.items()})
