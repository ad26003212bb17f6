"""The linear layers of one SmolLM2-135M pass by MKL, per row count: mm(W, x^T) and F.linear for each
weight shape, over that shape's real number of copies (weights streaming from memory as in a pass),
2 threads; the last column adds up a whole pass's linears taking the faster of the two per shape.
Chose compiled.WIDTH_BUCKETS: 9-15 rows cost as much as 16 or more, 17-31 about as much as 32.

    python benchmarks/results/issue19_engine/scripts/gemm_rows.py > gemm_rows_avx512.txt
"""
import torch, time
torch.manual_seed(0); torch.set_num_threads(2)
def tm(fn, reps=5):
    fn(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return sorted(ts)[reps//2]*1e3
shapes={"head":(49152,576,1),"up":(1536,576,60),"down":(576,1536,30),"q":(576,576,60),"kv":(192,576,60)}
Ws={k:[torch.randn(N,K) for _ in range(n)] for k,(N,K,n) in shapes.items()}
print("M " + " ".join(f"{k}:mm/lin" for k in shapes))
tot={}
for M in list(range(2,34))+[40,48]:
  line=[];s_mm=0;s_best=0
  for name,(N,K,n) in shapes.items():
    W=Ws[name]; x=torch.randn(M,K)
    a=tm(lambda: [torch.mm(w,x.t()) for w in W]); b=tm(lambda: [torch.nn.functional.linear(x,w) for w in W])
    mult={"head":1,"up":2,"down":1,"q":2,"kv":2}[name]*30/n if name!="head" else 1
    s_best+=min(a,b)*mult
    line.append(f"{a/n:.3f}/{b/n:.3f}")
  print(M, " ".join(line), f"pass-linears-best {s_best:.1f} ms  per-row {s_best/M:.2f}", flush=True)
