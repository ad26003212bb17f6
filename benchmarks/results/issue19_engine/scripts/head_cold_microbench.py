import torch, time
from diffspec.greedy_head import GreedyHead
from diffspec.kernels import mm_linear
torch.set_num_threads(2)
V,H=49152,576
lin=torch.nn.Linear(H,V,bias=False); lin.weight.data*=0.2
head=GreedyHead.of(lin,("bf16","int8"))
junk=torch.empty(64*1024*1024//4*4)  # 256 MB
def tm(f, n=9):
    ts=[]
    for _ in range(n):
        junk.add_(1.0)  # stream 256 MB through the caches
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return sorted(ts)[n//2]*1e3
g=torch.Generator().manual_seed(0)
for r in [1,2,4,6,8,16]:
    x=lin.weight.detach()[torch.randint(0,V,(r,),generator=g)]*10
    print(r, "fp32 mm %.2f" % tm(lambda: mm_linear(x, lin.weight, None).argmax(-1)),
          "bf16 %.2f" % tm(lambda: head.tokens(x,"bf16")), "int8 %.2f" % tm(lambda: head.tokens(x,"int8")))
