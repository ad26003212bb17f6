"""Memory bandwidth as torch sees it on this machine: a sum over 512 MB, and one-row F.linear over 200
MLP-shaped weights (700 MB, streaming) in fp32 and bf16; median of 7 / 5.

    python benchmarks/results/issue19_engine/scripts/bandwidth.py
"""
import torch
import torch.nn.functional as F

from diffspec.timing import median_seconds

torch.set_num_threads(2)
a = torch.ones(128 * 2**20)  # 512 MB
m = median_seconds(lambda: a.sum(), repeats=7, warmup=0)
print("sum fp32 512MB", f"{m*1e3:.1f} ms, {512/1024/m:.1f} GB/s")
x = torch.randn(1, 576)
Ws = [torch.randn(1536, 576) for _ in range(200)]  # 700 MB of MLP-shaped weights, streaming
for name, ws, xs, size in (("GEMV 1x576 @ 200 x (1536x576) fp32", Ws, x, 4),
                           ("same bf16", [w.to(torch.bfloat16) for w in Ws], x.to(torch.bfloat16), 2)):
    m = median_seconds(lambda: [F.linear(xs, w) for w in ws], repeats=5, warmup=0)
    print(f"{name}: {m*1e3:.1f} ms, {200*1536*576*size/2**30/m:.1f} GB/s")
