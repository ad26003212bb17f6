"""Issue 19: the conditioned drafter's context keys/values eager vs compiled (compile_choice._compile_extra_parts),
interleaved in one process; draft ms per round of fixed gamma 7 under --compile on (transformers backend).

    python benchmarks/results/issue19_engine/scripts/ab_context_kv.py
"""
import sys, time, torch
from diffspec.api import load_engine
eng = load_engine(drafter="conditioned", policy="fixed", gamma=7, backend="transformers", compile="on", quiet=True)
d = eng.drafter
prompts = ["Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
           "Explain the difference between a list and a tuple in Python.",
           "What is 17 * 23? Show your steps."]
eng.generate(prompts[0], max_new_tokens=32)
extras = dict(d._compiled_extras)
res = {"eager-flush": [], "compiled-flush": []}
for turn in range(3):
    for name in res:
        d._compiled_extras = extras if name == "compiled-flush" else {}
        for p in prompts:
            r = eng.generate(p, max_new_tokens=96)
            res[name] += [x.draft_time_s for x in r.rounds if x.drafted]
for name, v in res.items():
    v = sorted(v); print(name, "draft ms/round median %.2f mean %.2f n %d" % (1e3 * v[len(v)//2], 1e3 * sum(v)/len(v), len(v)))
