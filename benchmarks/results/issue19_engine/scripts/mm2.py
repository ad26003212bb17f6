import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def tm(f, reps=20):
    for _ in range(3): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return ts[len(ts)//2] * 1e6
# a pool of distinct weights bigger than L3, so every call streams from memory as in a real pass
for name, (n, kdim), copies in (("lm_head", (49152, 576), 1), ("mlp_up", (1536, 576), 60)):
    Ws = [torch.randn(n, kdim) for _ in range(copies)]
    Wts = [w.t().contiguous() for w in Ws]
    def run(f):
        def g():
            for i in range(copies):
                f(i)
        return g
    for M in (1, 2, 3, 5, 9, 17, 33, 65):
        x = torch.randn(M, kdim)
        xt = x.t().contiguous()
        r = {"linear": tm(run(lambda i: F.linear(x, Ws[i]))),
             "mm(W,xT)": tm(run(lambda i: torch.mm(Ws[i], x.t()))),
             "mm(W,xTc)": tm(run(lambda i: torch.mm(Ws[i], xt))),
             "x@Wt": tm(run(lambda i: torch.mm(x, Wts[i])))}
        if M == 1:
            r["mv"] = tm(run(lambda i: torch.mv(Ws[i], x[0])))
        gb = n * kdim * 4 * copies / 1e9
        best = min(r, key=r.get)
        print(f"{name} M={M}: " + "  ".join(f"{a} {b/copies:.0f}us" for a, b in r.items()) + f"  best {best} {gb / (r[best] * 1e-6):.1f} GB/s", flush=True)
