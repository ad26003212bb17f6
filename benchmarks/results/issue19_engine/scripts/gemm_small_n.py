"""GFLOP/s of the output head (49152 x 576, fp32, weights streaming) per row count, as mm(W, x^T) and F.linear,
beside a 2048^3 square GEMM: how far the wide verify passes sit from what MKL reaches on this CPU.
    python gemm_small_n.py"""
import torch, time
torch.set_num_threads(2)
def t(f, n=20):
    f(); f()
    ts=[]
    for _ in range(n):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]
A=torch.randn(2048,2048); B=torch.randn(2048,2048)
dt=t(lambda: A@B, 5); print("square 2048 GFLOP/s", 2*2048**3/dt/1e9)
W=torch.randn(49152,576)
for n in (1,2,8,9,16,17,24,32,64):
    x=torch.randn(n,576)
    d1=t(lambda: torch.mm(W, x.t()))
    d2=t(lambda: torch.nn.functional.linear(x, W))
    xt=x.t().contiguous()
    print(n, "mm(W,xT) %.2f ms %.0f GF/s | linear %.2f ms %.0f GF/s"%(d1*1e3, 2*49152*576*n/d1/1e9, d2*1e3, 2*49152*576*n/d2/1e9))
