import torch, time
import torch.utils.mkldnn
import torch.nn.functional as F
torch.set_num_threads(2)
shapes = {"q":(576,576),"kv":(192,576),"up":(1536,576),"down":(576,1536),"head":(49152,576)}
def bench(f, reps=20):
    for _ in range(3): f()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
for rows in (4, 16, 33, 65):
    for name,(o,i) in shapes.items():
        W = torch.randn(o,i)/i**0.5; x = torch.randn(rows,i)
        lin = torch.nn.Linear(i,o,bias=False); lin.weight.data = W
        ml2 = torch.utils.mkldnn.to_mkldnn(lin.requires_grad_(False))
        with torch.no_grad():
            a = bench(lambda: F.linear(x, W))
            b = bench(lambda: torch.mm(W, x.t()))
            c = bench(lambda: ml2(x.to_mkldnn()).to_dense())
            d = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(W, None, rows) if False else Wp[0], None, "none", [], ""))  if False else float('nan')
        print(f"rows {rows:3d} {name:5s} F.linear {a:7.3f}  mm(W,xT) {b:7.3f}  mkldnn {c:7.3f} ms  gflops F {2*rows*o*i/a/1e6:6.1f} mkldnn {2*rows*o*i/c/1e6:6.1f}")
