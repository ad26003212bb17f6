import torch, time
import torch.nn.functional as F
from diffspec.kernels import mm_linear
torch.set_num_threads(2)
def bench(f, reps=30):
    for _ in range(3): f()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
# weights streaming: many distinct copies so the cache does not hold them
Ws=[torch.randn(8192,576) for _ in range(6)]
for rows in (1,2,4,8,15,16):
    x=torch.randn(rows,576); i=[0]
    def nxt():
        i[0]=(i[0]+1)%6; return Ws[i[0]]
    a=bench(lambda: F.linear(x,nxt())); b=bench(lambda: mm_linear(x,nxt(),None))
    print(rows, f"F.linear {a:.3f} mm_linear {b:.3f} ratio {a/b:.2f}")
