"""Where a round goes, in the engine: plain and prompt lookup (auto policy) on the first N HumanEval prompts, 256
tokens, two passes (the first a warm-up); per draft length k, the median verify and draft ms a round.

    python round_overhead.py 8 > round_overhead_avx512.txt
"""
import time, statistics, json, sys, torch
from collections import defaultdict
from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
prompts = [p.text for p in load_bench_prompts("humaneval", n)]
kw = dict(backend="transformers", kernels="auto", quiet=True)
pl = load_engine(drafter="prompt-lookup", policy="auto", **kw)
base = load_engine(drafter=None, **kw)
res = defaultdict(list)
for rep in range(2):
    for p in prompts:
        for name, eng in (("plain", base), ("pl", pl)):
            r = eng.generate(p, max_new_tokens=256)
            if rep == 0: continue
            acc = sum(s.draft_time_s + s.verify_time_s for s in r.rounds)
            res[name].append(dict(wall=r.wall_time_s, prefill=r.prefill_time_s, rounds=len(r.rounds), acc=acc,
                                  tokens=len(r.token_ids),
                                  draft=sum(s.draft_time_s for s in r.rounds), verify=sum(s.verify_time_s for s in r.rounds),
                                  ks=[s.drafted for s in r.rounds], vt=[s.verify_time_s for s in r.rounds],
                                  dt=[s.draft_time_s for s in r.rounds], acc_n=[s.accepted for s in r.rounds]))
for name, rows in res.items():
    W = sum(r["wall"] for r in rows); T = sum(r["tokens"] for r in rows); R = sum(r["rounds"] for r in rows)
    print(name, f"tok/s {T/W:.1f} rounds {R} wall {W:.2f} prefill {sum(r['prefill'] for r in rows):.2f} "
          f"draft {sum(r['draft'] for r in rows):.2f} verify {sum(r['verify'] for r in rows):.2f} "
          f"unaccounted {W-sum(r['prefill']+r['acc'] for r in rows):.2f}")
    byk = defaultdict(list); dk = defaultdict(list); ak = defaultdict(list)
    for r in rows:
        for k, v, d, a in zip(r["ks"], r["vt"], r["dt"], r["acc_n"]):
            byk[min(k, 20)].append(v); dk[min(k,20)].append(d); ak[min(k,20)].append(a)
    for k in sorted(byk):
        print(f"  k={k:2d} n={len(byk[k]):5d} verify med {1e3*statistics.median(byk[k]):.2f} ms  draft med {1e3*statistics.median(dk[k]):.3f} ms  acc mean {statistics.mean(ak[k]):.2f}")

