import time, statistics, collections
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec import fused_layers as FL, q8_linear as Q, target as T
acc = collections.defaultdict(list)
def timed(label, f):
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[label].append(1e3 * (time.perf_counter() - t0)); return r
    return g
prompts = [t for _, t in load_prompts("humaneval")[:3]]
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
e.generate(prompts[0], max_new_tokens=8)
fl = e.target.direct_pass.fused
fl.lib.diffspec_fused_layers = timed("C fused call", fl.lib.diffspec_fused_layers)
FL.FusedLayers.run = timed("FusedLayers.run", FL.FusedLayers.run)
Q.q8_linear = timed("head q8_linear", Q.q8_linear)
T.Target.forward = timed("Target.forward", T.Target.forward)
T.TargetOutput.greedy_tokens = timed("greedy", T.TargetOutput.greedy_tokens)
acc.clear()
for p in prompts:
    e.target.reset(); r = e.generate(p, max_new_tokens=256)
    for s in r.rounds: acc["round verify_time"].append(1e3 * s.verify_time_s)
for k, v in acc.items():
    print(f"{k:22s} n={len(v):4d} median {statistics.median(v):.3f} ms")
