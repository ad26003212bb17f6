"""CPU: compiled passes over the fixed-capacity cache (static shapes) against the position-indexed one
(dynamic length), SmolLM2-135M fp32, --kernels auto, interleaved, at 256 tokens of context."""
import sys, time, json, torch
import diffspec.cache as dc
from diffspec import compiled as C
from diffspec.target import Target
C.WIDTH_BUCKETS = (1, 4, 8)
cap = int(sys.argv[1]) if len(sys.argv) > 1 else 512
dc.FIXED_CAPACITY_MIN = cap
ids = torch.randint(0, 49000, (300,), generator=torch.Generator().manual_seed(0))
ts = {}
for name, kw in (("dynamic", dict(fixed_cache=False)), ("fixed", dict(fixed_cache=True))):
    t0 = time.time()
    ts[name] = Target.load(None, quiet=True, kernels="auto", compile="on", **kw)
    print(name, "start s", round(time.time() - t0, 1), ts[name].compiled.compile_s, ts[name].runtime()["cache"], flush=True)
for t in ts.values():
    t.reserve(300); t.forward(ids[:256], logits=False)
res = {}
for k in (0, 3, 7):
    ms = {n: [] for n in ts}
    for turn in range(9):
        for n, t in ts.items():
            t0 = time.perf_counter(); t.forward(ids[256:257 + k]); ms[n].append((time.perf_counter() - t0) * 1e3); t.truncate(256)
    res[k] = {n: round(sorted(v)[len(v) // 2], 2) for n, v in ms.items()}
    print("k", k, res[k], flush=True)
print(json.dumps({"capacity": cap, "ms": res}))
