"""Where a drafting round's time goes: wall-clock wrappers (no cProfile) around the conditioned drafter's parts,
engine at fixed gamma on HumanEval prompts.  python round_prof.py DRAFTER [gamma] [prompts]"""
import sys, time, statistics, collections, functools
import torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec.drafters import conditioned, conditioned_fused, prompt_lookup, base
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(owner, name, g)
P = conditioned_fused.FusedQ8Pass
for n in ("current", "context", "block", "head"):
    wrap(P, n, "q8." + n)
C = conditioned.ConditionedDrafter
for n in ("propose", "_block_states", "_head_logits", "_flush", "observe"):
    wrap(C, n, "drafter." + n)
wrap(conditioned, "draw_tokens", "draw_tokens")
wrap(prompt_lookup.NgramIndex, "continuation", "hints.continuation")
drafter = sys.argv[1]; gamma = int(sys.argv[2]) if len(sys.argv) > 2 else 2
nprompts = int(sys.argv[3]) if len(sys.argv) > 3 else 3
eng = load_engine(drafter=drafter, policy="fixed", gamma=gamma, backend="transformers", kernels="auto", quiet=True,
                  drafter_dtype="q8")
print(eng.drafter.describe())
wrap(type(eng.target), "forward", "target.forward")
prompts = [t for _, t in load_prompts("humaneval")[:nprompts]]
eng.generate(prompts[0], max_new_tokens=32)
acc.clear(); cnt.clear()
rounds = []
t0 = time.perf_counter()
for p in prompts:
    r = eng.generate(p, max_new_tokens=256)
    rounds += list(r.rounds)
wall = time.perf_counter() - t0
n = len(rounds)
print(f"rounds {n}, tokens {sum(s.emitted for s in rounds)}, tok/round {sum(s.emitted for s in rounds)/n:.3f}, wall {wall:.2f}s")
print(f"per round ms: draft {1e3*sum(s.draft_time_s for s in rounds)/n:.3f} verify {1e3*sum(s.verify_time_s for s in rounds)/n:.3f}")
for k in sorted(acc):
    print(f"  {k:22s} {1e3*acc[k]/n:7.3f} ms/round  ({cnt[k]} calls, {1e3*acc[k]/max(cnt[k],1):.3f} ms/call)")
