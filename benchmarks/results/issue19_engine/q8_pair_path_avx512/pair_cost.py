import time, torch
from diffspec import q8_linear as Q
torch.manual_seed(0)
lib = Q.library()
def bench(K, N, R, reps=200):
    w = Q.quantized_pack(torch.randn(N, K) * 0.05).q8
    x = torch.randn(R, K)
    for _ in range(10): Q.q8_linear(x, w, lib)
    t = time.perf_counter()
    for _ in range(reps): Q.q8_linear(x, w, lib)
    dt = (time.perf_counter() - t) / reps
    return dt, R * K * N / dt / 1e9
for R in (1, 3, 8, 16):
    for K in (512, 576, 1024, 1536):
        dt, g = bench(K, 3072, R)
        print(f"R={R:2d} K={K:4d} N=3072: {dt*1e3:.3f} ms  {g:6.1f} GMAC/s")
