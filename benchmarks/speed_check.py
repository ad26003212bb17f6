"""Measured wall-clock speed of drafter x policy configurations against plain decoding.

    python benchmarks/speed_check.py --configs none prompt-lookup:failfast prompt-lookup:fixed:8 \
        --max-new-tokens 128 --repeats 3 --out benchmarks/results/issue2_prompt_lookup.json

Discipline: one warm-up generation per configuration first; then, for each prompt and repeat,
every configuration runs in turn (interleaved, so machine drift hits all alike); the median wall
time over repeats is reported per prompt, with tokens/s, speedup over `none` on the same prompt,
mean accepted length and forward-pass counts. Greedy outputs are compared token for token with
`none`; any difference is printed and makes the script exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch

from diffspec import SpeculativeEngine, Target, make_drafter, make_policy

DEFAULT_PROMPTS = [
    ("code", "Write a Python function `is_prime(n)` that checks whether a number is prime, with a docstring "
             "and three doctest examples."),
    ("rewrite", "Rewrite the following sentence replacing 'cat' with 'dog' and keep everything else the same: "
                "The cat sat on the mat, and the cat looked at the other cat that sat on the mat next to the door."),
    ("chat", "Explain the difference between a list and a tuple in Python."),
]


def parse_config(text: str):
    """'none' | 'DRAFTER:fixed:G' | 'DRAFTER:failfast[:tau:n:n_max]'."""
    parts = text.split(":")
    if parts[0] == "none":
        return "none", None, make_policy("fixed", gamma=0)
    drafter, policy = parts[0], parts[1] if len(parts) > 1 else "failfast"
    if policy == "fixed":
        return text, drafter, make_policy("fixed", gamma=int(parts[2]) if len(parts) > 2 else 8)
    nums = parts[2:]
    kw = {}
    if nums:
        kw = dict(tau=float(nums[0]), n=int(nums[1]), n_max=int(nums[2]))
    return text, drafter, make_policy("failfast", **kw)


def machine_info() -> dict:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":")[1].split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    import transformers
    return {"cpu_flags": sorted(flags), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit,
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", nargs="+", default=["none", "prompt-lookup:failfast"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--datasets", default=None,
                    help="comma list of humaneval,mtbench,champ (first --num-prompts of each); default: 3 built-in prompts")
    ap.add_argument("--num-prompts", type=int, default=5)
    args = ap.parse_args()
    prompts = DEFAULT_PROMPTS
    if args.datasets:
        from diffspec.datasets import load_prompts
        prompts = [(f"{name}:{pid}", text) for name in args.datasets.split(",")
                   for pid, text in load_prompts(name)[: args.num_prompts]]

    target = Target.load(args.model, quiet=True)
    configs = [parse_config(c) for c in args.configs]
    if configs[0][0] != "none":
        configs.insert(0, parse_config("none"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random-init drafters warn; the table says which drafter ran
        engines = {name: SpeculativeEngine(target, make_drafter(d, target), pol) for name, d, pol in configs}

    for name, engine in engines.items():  # warm-up
        engine.generate(DEFAULT_PROMPTS[0][1], max_new_tokens=16)

    rows, failures = [], 0
    for pid, prompt in prompts:
        times = {name: [] for name in engines}
        results = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                r = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
                times[name].append(time.perf_counter() - t0)
                results[name] = r
        base = statistics.median(times["none"])
        for name, r in results.items():
            wall = statistics.median(times[name])
            same = r.token_ids == results["none"].token_ids
            failures += not same
            rows.append({"prompt_id": pid, "config": name, "new_tokens": len(r.token_ids),
                         "wall_time_s": round(wall, 3), "tokens_per_s": round(len(r.token_ids) / wall, 2),
                         "speedup": round(base / wall, 3), "mean_accepted_length": round(r.mean_accepted_length, 3),
                         "rounds": r.num_rounds, "drafted": r.drafted_tokens, "accepted": r.accepted_tokens,
                         "target_forward_passes": r.target_forward_passes,
                         "drafter_forward_passes": r.drafter_forward_passes,
                         "draft_time_s": round(r.draft_time_s, 3), "verify_time_s": round(r.verify_time_s, 3),
                         "drafter_passes_per_round": round(r.drafter_forward_passes / max(1, sum(1 for x in r.rounds if x.drafted)), 2),
                         "ms_per_drafter_pass": round(1000 * r.draft_time_s / r.drafter_forward_passes, 2) if r.drafter_forward_passes else None,
                         "ms_per_verify": round(1000 * r.verify_time_s / r.num_rounds, 2),
                         "identical_to_none": same})
            if not same:
                print(f"LOSSLESS FAILURE: {name} differs from none on prompt {pid}", file=sys.stderr)

    header = ("| prompt | config | tokens | tok/s | speedup vs none | mean acc. len | target passes | drafter passes | "
              "drafter passes/round | ms/drafter pass | ms/verify | identical |")
    print(header)
    print("|" + "---|" * 12)
    for r in rows:
        print(f"| {r['prompt_id']} | {r['config']} | {r['new_tokens']} | {r['tokens_per_s']} | {r['speedup']}x | "
              f"{r['mean_accepted_length']} | {r['target_forward_passes']} | {r['drafter_forward_passes']} | "
              f"{r['drafter_passes_per_round']} | {r['ms_per_drafter_pass']} | {r['ms_per_verify']} | {r['identical_to_none']} |")
    info = machine_info()
    print()
    print("| config | mean speedup | median speedup | min-max | mean acc. len | tok/s (sum tokens / sum time) |")
    print("|---|---|---|---|---|---|")
    for name in engines:
        rs = [r for r in rows if r["config"] == name]
        sp = sorted(r["speedup"] for r in rs)
        tps = sum(r["new_tokens"] for r in rs) / sum(r["wall_time_s"] for r in rs)
        print(f"| {name} | {statistics.mean(sp):.3f}x | {statistics.median(sp):.3f}x | {sp[0]:.2f}-{sp[-1]:.2f} | "
              f"{statistics.mean(r['mean_accepted_length'] for r in rs):.3f} | {tps:.2f} |")
    print(json.dumps(info))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": info, "max_new_tokens": args.max_new_tokens,
                       "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
