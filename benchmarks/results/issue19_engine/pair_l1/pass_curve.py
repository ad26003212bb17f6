import time, statistics, torch
from diffspec.api import load_engine
eng = load_engine(drafter=None, policy="fixed", backend="transformers", kernels="auto", quiet=True)
t = eng.target
ctx = torch.randint(100, 30000, (256,))
res = {}
for turn in range(3):
    for k in (0, 2, 4, 5, 6, 7, 8, 11):
        ts = []
        for r in range(7):
            t.reset(); t.reserve(400)
            t.forward(ctx, logits=False)
            x = torch.randint(100, 30000, (k + 1,))
            a = time.perf_counter(); out = t.forward(x); g = out.greedy_tokens(); ts.append(time.perf_counter() - a)
        res.setdefault(k, []).append(statistics.median(ts))
import sys; print(sys.argv[1], " ".join(f"k={k}:{1e3*min(v):.2f}" for k, v in res.items()))
print("ratio to k=0:", " ".join(f"{k}:{min(v)/min(res[0]):.2f}" for k, v in res.items()))
