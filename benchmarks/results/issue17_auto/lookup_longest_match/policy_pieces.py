"""The policy and drafter work of a prompt-lookup round timed inside the engine (after each forward pass, when the
weights have streamed through the caches): plan_round, propose, next_increment, final_length, per call; then the
source's look_cost against the cheap limit. 3 prompts a set, 256 tokens.

    python policy_pieces.py > policy_pieces_avx512_820183f.txt

The same script on 9bf06d4 (this session's first measurement, before the change) gave per call: plan_round 20 us,
propose 83 us median (121 mean), next_increment 57 us mean, final_length 85 us; look_cost 243 us against 169 us,
speculation off in 532 of 1334 rounds.
"""
import time, sys, statistics, collections, torch
from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafters.prompt_lookup import PromptLookupDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import AutoPolicy
from diffspec import types as T

prompts = [p.text for s in ("humaneval", "mtbench", "champ") for p in load_bench_prompts(s, 3)]
plain = load_engine(drafter="none", policy="fixed", backend="transformers", quiet=True)
pol = AutoPolicy(); dr = PromptLookupDrafter()
eng = SpeculativeEngine(plain.target, dr, pol)
acc = collections.defaultdict(list)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[key].append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
wrap(pol, "plan_round", "plan_round"); wrap(dr, "propose", "propose"); wrap(pol, "final_length", "final_length")
wrap(pol, "next_increment", "next_increment")
eng.generate(prompts[0], max_new_tokens=32)
acc.clear()
res = [eng.generate(p, max_new_tokens=256) for p in prompts]
rounds = sum(len(r.rounds) for r in res)
print("rounds", rounds, "off", sum(r.speculation_off_rounds for r in res), "draft_time ms/round", 1e3 * sum(r.draft_time_s for r in res) / rounds)
for k, v in acc.items():
    print(f"{k:15s} n={len(v):5d} median {1e6*statistics.median(v):7.1f} us mean {1e6*statistics.mean(v):7.1f} us total/round {1e6*sum(v)/rounds:6.1f} us")
src = pol.sources[dr.name] if dr.name in pol.sources else list(pol.sources.values())[0]
print("look_cost us", 1e6 * src.look_cost, "cheap threshold us", 1e6 * pol.cheap_share * pol._curve[0], "run_seconds sample", [round(1e6*x) for x in list(src.run_seconds)[:20]])
