import time, statistics, collections, functools, sys, torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec.target import Target
acc = collections.defaultdict(list)
cur = [None]
orig = Target.forward
def fwd(self, tokens, *a, **k):
    t0 = time.perf_counter()
    out = orig(self, tokens, *a, **k)
    if tokens.shape[0] <= 8 and self.cache_len > 0:
        acc[(cur[0], tokens.shape[0], bool(k.get("hidden_layers")))].append(1e3 * (time.perf_counter() - t0))
    return out
Target.forward = fwd
prompts = [t for _, t in load_prompts("humaneval")[:3]]
D = "/work/runs27/hints4/drafter"
engs = {"plain": load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True),
        "k2": load_engine(drafter=D, policy="fixed", gamma=2, backend="transformers", kernels="q8", quiet=True, drafter_dtype="q8"),
        "k2nodraft": None}
for name in ("plain", "k2"):
    cur[0] = "warm"; engs[name].generate(prompts[0], max_new_tokens=32)
for rep in range(2):
    for name in ("plain", "k2"):
        cur[0] = name
        for p in prompts:
            engs[name].generate(p, max_new_tokens=256)
for k, v in sorted((k, v) for k, v in acc.items() if k[0] != "warm"):
    print(k, len(v), f"median {statistics.median(v):.3f} mean {statistics.mean(v):.3f}")
