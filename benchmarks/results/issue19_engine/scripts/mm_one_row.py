"""One row (and a few) through each of SmolLM2-135M's weight shapes, weights streaming from memory
(enough copies to exceed the caches), 2 threads, median us per matrix: F.linear (MKL GEMV for one row),
mm(W, x^T), the padded two-column mm(W, [x; x]^T) (one row only), MKL-packed and oneDNN linears, bf16."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)


def tm(f, reps=9):
    for _ in range(2):
        f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e6


for name, (n, k), copies in (("lm_head", (49152, 576), 1), ("mlp_up", (1536, 576), 60), ("mlp_down", (576, 1536), 30),
                             ("q", (576, 576), 60), ("kv", (192, 576), 120)):
    Ws = [torch.randn(n, k) for _ in range(copies)]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in Ws]
    onednn = [w.to_mkldnn() for w in Ws]
    bf = [w.to(torch.bfloat16) for w in Ws]

    def each(f):
        return lambda: [f(i) for i in range(copies)]

    for M in (1, 2, 4, 8, 16):
        x = torch.randn(M, k)
        xx = torch.cat((x, x))
        r = {"F.linear": tm(each(lambda i: F.linear(x, Ws[i]))),
             "mm(W,xT)": tm(each(lambda i: torch.mm(Ws[i], x.t())))}
        if M == 1:
            r["mm(W,[x;x]T)"] = tm(each(lambda i: torch.mm(Ws[i], xx.t())))
        r["mkl-packed"] = tm(each(lambda i: torch.ops.mkl._mkl_linear(x, packed[i], Ws[i], None, M)))
        r["onednn"] = tm(each(lambda i: torch._C._nn.mkldnn_linear(x.to_mkldnn(), onednn[i], None).to_dense()))
        r["bf16 F.linear"] = tm(each(lambda i: F.linear(x.to(torch.bfloat16), bf[i])))
        print(f"{name} {n}x{k} rows={M}: " + "  ".join(f"{a} {b / copies:.0f}" for a, b in r.items()), flush=True)
