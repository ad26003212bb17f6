"""The q8 target's pass + greedy choice at 256 positions of context, by rows (1..16), 25 timed of 30 per shape,
shapes interleaved; prints one JSON line (median ms per row count) and appends it to the file named."""
import json, statistics, sys, time, torch
import diffspec
from diffspec.api import load_engine
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
t = e.target
ids = torch.randint(100, 20000, (300,), generator=torch.Generator().manual_seed(0))
t.prefill(ids[:256], 300)
L, res = 256, {}
ROWS = (1, 2, 3, 4, 8, 16)
for rep in range(30):
    for n in ROWS:
        t0 = time.perf_counter()
        t.forward(ids[L:L + n]).greedy_tokens()
        dt = time.perf_counter() - t0
        t.truncate(L)
        if rep >= 5:
            res.setdefault(n, []).append(dt * 1e3)
out = {"src": diffspec.__file__, **{str(n): round(statistics.median(v), 3) for n, v in res.items()}}
print(json.dumps(out)); open(sys.argv[1], "a").write(json.dumps(out) + "\n")
