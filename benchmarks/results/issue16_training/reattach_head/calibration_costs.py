import time, torch, statistics
from diffspec.backends import load_target
from diffspec.drafter_names import make_drafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies.auto import calibrate_drafter
t = load_target(None, backend="transformers", quiet=True, drafters=("conditioned",))
d = make_drafter("conditioned", t, compute_dtype="auto")
d.attach(t)
print(d.describe())
for rep in range(2):
    cal = calibrate_drafter(t, d, engine_type=SpeculativeEngine)
    c = cal["costs"]
    for g in (2, 8):
        pass
    ks = sorted(set(k for k, _ in c))
    for k in ks:
        v = [s for kk, s in c if kk == k]
        print(rep, "k", k, "n", len(v), "median ms", round(statistics.median(v)*1e3, 2))
from diffspec.policies import make_policy
from diffspec.policies.fixed import FixedPolicy
from diffspec.policies.auto import CALIBRATION_PROMPTS
ids = t.encode_prompt("Write a Python function that checks whether a number is prime.", chat=True)
for label, eng in (("make_policy", SpeculativeEngine(t, d, make_policy("fixed", gamma=2))),
                   ("inexact", SpeculativeEngine(t, d, FixedPolicy(gamma=2), allow_inexact=True))):
    eng.generate(ids, max_new_tokens=8)
    r = eng.generate(ids, max_new_tokens=64)
    print(label, "median draft ms", round(statistics.median([x.draft_time_s for x in r.rounds])*1e3, 2))
    p = t.encode_prompt(CALIBRATION_PROMPTS[0], chat=True)
    r = eng.generate(p, max_new_tokens=32)
    print(label, "cal prompt median draft ms", round(statistics.median([x.draft_time_s for x in r.rounds])*1e3, 2), len(p))
