import time, statistics, torch
from diffspec.api import load_engine
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
t = e.target
ids = torch.randint(100, 20000, (300,))
t.reset() if hasattr(t, "reset") else None
t.prefill(ids[:256], 400)
L = 256
res = {}
for rep in range(40):
    for n in (1, 2, 3, 4):
        for hl in ((), (1, 14, 27)):
            t0 = time.perf_counter()
            out = t.forward(ids[L:L + n], hidden_layers=hl)
            g = out.greedy_tokens()
            dt = time.perf_counter() - t0
            t.truncate(L)
            if rep >= 5:
                res.setdefault((n, bool(hl)), []).append(dt * 1e3)
for k, v in sorted(res.items()):
    print(k, f"median {statistics.median(v):.3f} ms")
