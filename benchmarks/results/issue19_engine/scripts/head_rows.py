"""The 49152 x 576 output head per row count: fp32 F.linear, mm(W, x^T), bf16 F.linear (a 64 MB buffer
touched before each call, so the weights come mostly from memory); median of 7.

    python benchmarks/results/issue19_engine/scripts/head_rows.py
"""
import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
W = torch.randn(49152, 576) * 0.05
Wb = W.to(torch.bfloat16)
flush = torch.empty(64 * 2**20 // 4)
def t(f, reps=7):
    ts = []
    for _ in range(reps):
        flush.add_(1)  # evict some cache
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3
for m in list(range(1, 18)) + [20, 24, 25, 28, 32, 33]:
    x = torch.randn(m, 576)
    xb = x.to(torch.bfloat16)
    print(f"rows {m:2d}: fp32 {t(lambda: F.linear(x, W)):6.2f}  mm(W,xT) {t(lambda: torch.mm(W, x.t())):6.2f}  bf16 {t(lambda: F.linear(xb, Wb)):6.2f}", flush=True)
