# Where a one-row step of the default target goes, inside the engine (the fused layers' C call, the Python around it, the head).
# python benchmarks/results/issue19_engine/fused_layers/step_split.py
import time, statistics, torch
from diffspec.target import Target
import diffspec.fused_layers as FL, diffspec.llama_pass as LP
t = Target.load(kernels="auto", quiet=True)
ids = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0))
t.reset(); t.reserve(300); t.forward(ids[:256], logits=False)
rec = {}
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def f(*a, **k):
        t0 = time.perf_counter(); r = orig(*a, **k); rec.setdefault(key, []).append(time.perf_counter() - t0); return r
    setattr(obj, name, f)
lib = t.direct_pass.fused.lib
class L:  # proxy the C call
    def __init__(s, lib): s.lib = lib
    def __getattr__(s, n): return getattr(s.lib, n)
proxy = L(lib)
orig_call = lib.diffspec_fused_layers
def ccall(*a):
    t0 = time.perf_counter(); orig_call(*a); rec.setdefault('C call', []).append(time.perf_counter() - t0)
proxy.diffspec_fused_layers = ccall
t.direct_pass.fused.lib = proxy
wrap(FL.FusedLayers, 'run', 'fused.run')
wrap(LP.LlamaPass, '_head', '_head')
wrap(LP.LlamaPass, 'forward', 'LlamaPass.forward')
wrap(t.direct_pass.rotary, 'forward', 'rotary')
steps = []
for rep in range(60):
    t0 = time.perf_counter(); o = t.forward(ids[256:257]); g = o.greedy_tokens(); steps.append(time.perf_counter() - t0); t.truncate(256)
print("step", round(statistics.median(steps)*1e3, 3))
for k, v in rec.items(): print(k, round(statistics.median(v)*1e3, 3))
import timeit
f = t.direct_pass.fused
print("_packs us", timeit.timeit(lambda: f._packs(1), number=200)/200*1e6)
cl = t._cache.layers
print("advance+view us", timeit.timeit(lambda: [c._view() for c in cl], number=200)/200*1e6)
print("table_for us", timeit.timeit(lambda: f._table_for(f._packs(1), cl), number=200)/200*1e6)
