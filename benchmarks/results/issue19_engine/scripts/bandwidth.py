"""Memory bandwidth as torch sees it on this machine: a sum over 512 MB, and one-row F.linear over 200
MLP-shaped weights (700 MB, streaming) in fp32 and bf16; median of 7 / 5.

    python benchmarks/results/issue19_engine/scripts/bandwidth.py
"""
import time, torch
torch.set_num_threads(2)
a = torch.ones(128 * 2**20)  # 512 MB
for f, name in ((lambda: a.sum(), "sum fp32 512MB"), ):
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    m = sorted(ts)[3]; print(name, f"{m*1e3:.1f} ms, {512/1024/m:.1f} GB/s")
import torch.nn.functional as F
W = torch.randn(1536, 576); x = torch.randn(1, 576)
Ws = [torch.randn(1536, 576) for _ in range(200)]  # 700 MB of MLP-shaped weights, streaming
ts = []
for _ in range(5):
    t0 = time.perf_counter()
    for w in Ws: F.linear(x, w)
    ts.append(time.perf_counter() - t0)
m = sorted(ts)[2]; print(f"GEMV 1x576 @ 200 x (1536x576) fp32: {m*1e3:.1f} ms, {200*1536*576*4/2**30/m:.1f} GB/s")
Wb = [w.to(torch.bfloat16) for w in Ws]; xb = x.to(torch.bfloat16)
ts = []
for _ in range(5):
    t0 = time.perf_counter()
    for w in Wb: F.linear(xb, w)
    ts.append(time.perf_counter() - t0)
m = sorted(ts)[2]; print(f"same bf16: {m*1e3:.1f} ms, {200*1536*576*2/2**30/m:.1f} GB/s")
