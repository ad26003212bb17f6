"""In-process A/B of q8_linear.c's non-temporal prefetch: the same source built with -DQ8_PREFETCH=0 (off) and with
its default, swapped into one q8 target (the fused layers' library and the head's) prompt by prompt; plain decoding,
256 tokens a prompt, rotating order after a warm-up; outputs compared."""
import json, statistics, sys, time
from diffspec import fused_layers as FL, q8_linear as Q
from diffspec.packed_linear import NATIVE
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
variants = {"off": NATIVE + ("-DQ8_PREFETCH=0",), "nta4": NATIVE + ("-DQ8_PREFETCH=4",), "nta8": NATIVE, "nta16": NATIVE + ("-DQ8_PREFETCH=16",), "nta32": NATIVE + ("-DQ8_PREFETCH=32",)}
libs = {k: (FL.build_library(f), Q.build_library(f)) for k, f in variants.items()}
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
fl = e.target.direct_pass.fused
orig_library = Q.library
def use(k):
    fl.lib = libs[k][0]
    Q.library = lambda isa_flags=NATIVE, _l=libs[k][1]: _l
prompts = [t for ds in ("humaneval", "mtbench", "champ") for _, t in load_prompts(ds)[:n]]
for k in variants:
    use(k); e.generate(prompts[0], max_new_tokens=32)
tot = {k: [0, 0.0] for k in variants}; per = {k: [] for k in variants}; ids = {}
names = list(variants)
for i, p in enumerate(prompts):
    for k in names[i % len(names):] + names[:i % len(names)]:
        use(k); e.target.reset()
        t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=256); dt = time.perf_counter() - t0
        tot[k][0] += len(r.token_ids); tot[k][1] += dt; per[k].append(len(r.token_ids) / dt)
        ids.setdefault(i, set()).add(tuple(r.token_ids))
same = all(len(v) == 1 for v in ids.values())
res = {k: round(v[0] / v[1], 1) for k, v in tot.items()}
print(json.dumps({"tok_s": res, "over_off": {k: round(v / res["off"], 3) for k, v in res.items()}, "same_tokens": same}))
