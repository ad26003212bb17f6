"""Greedy match rate of two methods of `diffspec bench` folders, prompt by prompt: how many prompts
give identical tokens, and how many tokens agree before the first difference.

    python benchmarks/results/issue19_engine/scripts/match_rate.py BENCH_FOLDER [A plain] [B hf-generate] [--reference FOLDER]

With --reference, method B is read from that folder (e.g. hf-generate's outputs from an earlier run: transformers'
generate with F.linear, which our kernels do not touch), method A from BENCH_FOLDER.
"""
import argparse
import json
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("folder", type=Path)
ap.add_argument("a", nargs="?", default="plain")
ap.add_argument("b", nargs="?", default="hf-generate")
ap.add_argument("--reference", type=Path, help="the folder method B comes from (default: the same folder)")
args = ap.parse_args()


def outputs(folder: Path, method: str) -> dict:
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    return {(r["dataset"], r["prompt_id"]): r["token_ids"] for r in rows if r["method"] == method}


a, b = args.a, args.b
xs, ys = outputs(args.folder, a), outputs(args.reference or args.folder, b)
prompts = sorted(set(xs) & set(ys))
same, agree, total, firsts = 0, 0, 0, []
for d, p in prompts:
    x, y = xs[(d, p)], ys[(d, p)]
    n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    identical = x == y
    same += identical
    agree += len(x) if identical else n
    total += len(x)
    if not identical:
        firsts.append(f"{d}/{p}@{n}")
where = f" ({args.reference})" if args.reference else ""
print(f"{a} vs {b}{where}: {same}/{len(prompts)} prompts identical; {agree}/{total} of {a}'s tokens before the first "
      f"difference ({100 * agree / max(1, total):.1f}%)")
if firsts:
    print("first differences (new token index):", ", ".join(firsts))
