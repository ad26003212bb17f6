import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def tm(f, reps=15):
    for _ in range(2): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return ts[len(ts)//2] * 1e6
for name, (n, kdim), copies in (("lm_head", (49152, 576), 1), ("mlp_up", (1536, 576), 60), ("mlp_down", (576, 1536), 60), ("q", (576, 576), 120)):
    Ws = [torch.randn(n, kdim) for _ in range(copies)]           # row-major [N, K]
    Cs = [w.t().contiguous().t() for w in Ws]                     # column-major [N, K] view
    def run(f):
        def g():
            for i in range(copies):
                f(i)
        return g
    for M in (1, 2, 3, 5, 9, 17):
        x = torch.randn(M, kdim)
        r = {"R:linear": tm(run(lambda i: F.linear(x, Ws[i]))),
             "R:mm(W,xT)": tm(run(lambda i: torch.mm(Ws[i], x.t()))),
             "C:linear": tm(run(lambda i: F.linear(x, Cs[i]))),
             "C:mm(W,xT)": tm(run(lambda i: torch.mm(Cs[i], x.t())))}
        best = min(r, key=r.get)
        print(f"{name} M={M}: " + "  ".join(f"{a} {b/copies:.0f}" for a, b in r.items()) + f"  best {best}", flush=True)
