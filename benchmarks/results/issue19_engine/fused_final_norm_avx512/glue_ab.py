"""In-process A/B of the pass's glue (2026-11-30, 29th session): "old" = the rotary module called every pass and the
final norm as a torch call; "new" = the rotary table cut per pass and the final norm inside the fused C call.
Plain decoding, one engine, the variant switched per generation, order alternating per prompt, after a warm-up.

    python glue_ab.py KERNELS PROMPTS_PER_SET      (KERNELS: q8 or auto)
"""
import json, sys, time
from diffspec.api import load_engine
from diffspec.datasets import load_prompts

kernels, per_set = sys.argv[1], int(sys.argv[2])
e = load_engine(drafter="none", backend="transformers", kernels=kernels, quiet=True)
dp = e.target.direct_pass
norm = dp.fused.final_norm
assert norm is not None and dp.rotary_table.applies


def use(variant):
    dp.rotary_table.applies = variant == "new"
    dp.fused.final_norm = norm if variant == "new" else None


prompts = [t for s in ("humaneval", "mtbench", "champ") for _, t in load_prompts(s)[:per_set]]
for v in ("old", "new"):
    use(v); e.generate(prompts[0], max_new_tokens=32)
tot = {"old": [0, 0.0], "new": [0, 0.0]}
ratios, same = [], 0
for i, p in enumerate(prompts):
    order = ("old", "new") if i % 2 == 0 else ("new", "old")
    got = {}
    for v in order:
        use(v); e.target.reset()
        t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=256); dt = time.perf_counter() - t0
        got[v] = (len(r.token_ids), dt, r.token_ids)
        tot[v][0] += len(r.token_ids); tot[v][1] += dt
    same += got["old"][2] == got["new"][2]
    ratios.append(round((got["old"][1] / got["old"][0]) / (got["new"][1] / got["new"][0]), 3))
tps = {v: round(n / t, 1) for v, (n, t) in tot.items()}
print(json.dumps({"kernels": kernels, "prompts": len(prompts), "tok_s": tps, "ratio_new_over_old": round(tps["new"] / tps["old"], 3),
                  "per_prompt_ratios": ratios, "same_tokens_prompts": same}))
