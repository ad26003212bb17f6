"""The q8 kernel (q8_linear.c) against the float32 packed kernel (packed_linear.c) on SmolLM2-135M's weight shapes
(random GGUF codes of those shapes), interleaved, 2 threads; the time includes quantizing the activations.

    python benchmarks/results/issue19_engine/q8_activations/kernel_ab.py [--isa native|avx2]

--isa avx2 times both kernels' AVX2 builds (what the AVX2-only CPU kind runs) on this machine. Best of 5 turns of
`reps` calls; the weights stay in cache between calls (the head's 28 MB may too), so one-row figures are not the
engine's (there a step streams every weight from memory once): the wide rows are what this file is for."""
import argparse, time

import torch

from diffspec import packed_linear as pl, q8_linear as ql

ap = argparse.ArgumentParser()
ap.add_argument("--isa", default="native", choices=["native", "avx2"])
args = ap.parse_args()
flags = pl.NATIVE if args.isa == "native" else ("-mavx2", "-mfma")
f32_lib, q8_lib = pl.build_library(flags), ql.library(flags)
print("builds:", f32_lib.diffspec_packed_isa().decode(), q8_lib.diffspec_q8_isa().decode())
torch.manual_seed(0)
torch.set_num_threads(2)


def q4_weight(n, k):
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    return ((d * q) + m).reshape(n, k)


def q8_weight(n, k):
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[..., 0] = 127
    return ((torch.rand(n, k // 32, 1) * 0.001).half().float() * q).reshape(n, k)


shapes = [("q/k/v", q4_weight, 960, 576), ("o", q4_weight, 576, 576), ("gate/up", q4_weight, 3072, 576),
          ("down", q4_weight, 576, 1536), ("head", q8_weight, 49152, 576)]
packs = {name: pl.pack(make(n, k)) for name, make, n, k in shapes}
q8s = {name: ql.Q8Weight.of(p) for name, p in packs.items()}


def best_us(f, reps):
    f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


for name, _, n, k in shapes:
    p, q = packs[name], q8s[name]
    for rows in (1, 2, 4, 8, 16, 32):
        x = torch.randn(rows, k)
        reps = max(3, int(2000 / (rows * n * k / 1e6)))
        a = best_us(lambda: pl._run_kernel(x, p.codes, p.scales, p.offsets, lib=f32_lib), reps)
        b = best_us(lambda: ql.q8_linear(x, q, lib=q8_lib), reps)
        print(f"{name:8s} {n}x{k} rows {rows:2d}: float32 {a:8.1f} us, q8 {b:8.1f} us ({rows * n * k / b / 1e3:6.1f} "
              f"GMAC/s), q8 {a / b:4.2f}x faster", flush=True)
