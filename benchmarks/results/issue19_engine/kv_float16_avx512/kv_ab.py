"""In-process A/B of the q8 target's cache (2026-11-30, 29th session): "f32" = keys and values held as float32 (the
code before), "f16" = held as float16 (the default under --kernels q8 now). One engine, the cache made anew per
generation in the variant's dtype, order alternating per prompt, after a warm-up.

    python kv_ab.py plain PROMPTS_PER_SET MAX_NEW_TOKENS      plain decoding, 3 sets
    python kv_ab.py curve CONTEXT [CONTEXT ...]               pass + greedy choice by rows at a context of real text
"""
import json, statistics, sys, time
import torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts

e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
t = e.target
assert t.kv_storage == torch.float16
variants = {"f32": None, "f16": torch.float16}

if sys.argv[1] == "plain":
    per_set, new = int(sys.argv[2]), int(sys.argv[3])
    prompts = [p for s in ("humaneval", "mtbench", "champ") for _, p in load_prompts(s)[:per_set]]
    for v in variants.values():
        t.kv_storage = v; t.reset(); e.generate(prompts[0], max_new_tokens=32)
    tot = {k: [0, 0.0] for k in variants}
    ratios, same = [], 0
    for i, p in enumerate(prompts):
        got = {}
        for k in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            t.kv_storage = variants[k]; t.reset()
            t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=new); dt = time.perf_counter() - t0
            got[k] = (len(r.token_ids), dt, r.token_ids)
            tot[k][0] += len(r.token_ids); tot[k][1] += dt
        same += got["f32"][2] == got["f16"][2]
        ratios.append(round((got["f32"][1] / got["f32"][0]) / (got["f16"][1] / got["f16"][0]), 3))
    tps = {k: round(n / s, 1) for k, (n, s) in tot.items()}
    print(json.dumps({"prompts": len(prompts), "max_new_tokens": new, "tok_s": tps,
                      "ratio_f16_over_f32": round(tps["f16"] / tps["f32"], 3), "per_prompt_ratios": ratios,
                      "same_tokens_prompts": same}))
else:
    text = " ".join(p for _, p in load_prompts("humaneval")[:30])
    ids = torch.tensor(t.encode_prompt(text, chat=False)[:2100])
    rows = (1, 2, 3, 4, 8)
    for ctx in [int(c) for c in sys.argv[2:]]:
        caches = {}
        for k, v in variants.items():
            t.kv_storage = v; t.reset(); t.prefill(ids[:ctx], ctx + 64); caches[k] = t._cache
        res = {}
        for rep in range(30):
            for n in rows:
                for k in (list(variants) if rep % 2 else list(variants)[::-1]):
                    t._cache = caches[k]
                    t0 = time.perf_counter(); t.forward(ids[ctx:ctx + n]).greedy_tokens(); dt = time.perf_counter() - t0
                    t.truncate(ctx)
                    if rep >= 5: res.setdefault((n, k), []).append(dt * 1e3)
        print(f"context {ctx}: " + "  ".join(
            f"n{n} {statistics.median(res[(n, 'f32')]):.3f}->{statistics.median(res[(n, 'f16')]):.3f} "
            f"({statistics.median(res[(n, 'f16')]) / statistics.median(res[(n, 'f32')]):.3f})" for n in rows), flush=True)
