"""One-shot generation (a fresh process per run, as `diffspec generate` runs), the shipped conditioned drafter at
its fixed draft length, with its context keys/values in the model's dtype (bf16) or float32
(conditioned_pass.cache_dtype). Each run is its own process, so every context length is new to oneDNN, as in a
one-shot command; the variants alternate run by run.

    python oneshot_cache_dtype.py [--runs 4] [--max-new-tokens 256] [--prompt TEXT] [--json OUT]
    python oneshot_cache_dtype.py --child VARIANT ...   (one run; what the parent starts)
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=4)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
ap.add_argument("--child")
ap.add_argument("--json")
args = ap.parse_args()

if args.child:
    import diffspec.drafters.conditioned as C
    import diffspec.drafters.conditioned_pass as CP
    from diffspec.api import load_engine
    if args.child == "model dtype":
        CP.cache_dtype = C.cache_dtype = lambda d: d
    engine = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True)
    t = time.perf_counter()
    out = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t
    print(json.dumps({"variant": args.child, "cache": str(engine.drafter._cache.dtype), "seconds": seconds,
                      "tokens": len(out.token_ids), "token_ids": out.token_ids,
                      "rounds": len(out.rounds),
                      "drafter": engine.drafter.describe()}))
    sys.exit(0)

runs = []
for i in range(args.runs):
    for variant in ("model dtype", "float32"):
        cmd = [sys.executable, __file__, "--child", variant, "--max-new-tokens", str(args.max_new_tokens),
               "--prompt", args.prompt]
        row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        runs.append(row)
        print(row["variant"], row["cache"], f"{row['tokens'] / row['seconds']:.1f} tok/s", flush=True)
summary = {}
for variant in ("model dtype", "float32"):
    rs = [r for r in runs if r["variant"] == variant]
    summary[variant] = {"tok_s_each": [round(r["tokens"] / r["seconds"], 2) for r in rs],
                        "tok_s_total": round(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), 2)}
same = len({tuple(r["token_ids"]) for r in runs}) == 1
summary["ratio_float32_over_model_dtype"] = round(summary["float32"]["tok_s_total"] / summary["model dtype"]["tok_s_total"], 3)
summary["all_outputs_identical"] = same
summary["drafter"] = runs[0]["drafter"]
print(json.dumps(summary, indent=1))
if args.json:
    with open(args.json, "w") as f:
        json.dump({"summary": summary, "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}, f,
                  indent=1)
