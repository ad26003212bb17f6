"""The screened greedy head (greedy_head.py) against the fp32 head, end to end: plain decoding and the
default (`auto` drafter and policy), on one loaded model through two targets (the same kernel plan; one
with `screen_greedy_head=False`), each with its own cost tables (their fingerprints differ). The four
methods run interleaved prompt by prompt (the order rotating), after a warm-up prompt of each; greedy.
Headline: each method's throughput (total tokens / total time) and its ratio to fp32 plain decoding.
Every output is compared with fp32 plain decoding's.

    python benchmarks/results/issue19_engine/scripts/bench_greedy_head.py OUT.json \
        [--dataset humaneval] [--num-prompts 20] [--max-new-tokens 256] [--compile on]
"""
import argparse
import json
import subprocess
import time

import torch

from diffspec.bench.prompts import load_bench_prompts
from diffspec.drafter_names import make_drafter
from diffspec.engine import SpeculativeEngine
from diffspec.models import load_model_and_tokenizer
from diffspec.policies import make_policy
from diffspec.target import Target
from diffspec.types import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--dataset", default="humaneval")
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--compile", default="off")
args = ap.parse_args()
torch.set_num_threads(2)

started = time.time()
model, tok = load_model_and_tokenizer(None, quiet=False)
targets = {"fp32 head": Target(model, tok, kernels="auto", compile=args.compile, quiet=False, screen_greedy_head=False),
           "screened": Target(model, tok, kernels="auto", compile=args.compile, quiet=False)}
assert targets["screened"].greedy_head is not None, targets["screened"].runtime()["greedy_head"]
engines = {}
for name, t in targets.items():
    engines[f"plain, {name}"] = SpeculativeEngine(t, None, make_policy("fixed", gamma=1))
    d = make_drafter("auto", t, dtype=t.dtype, device="cpu", combine=True)
    engines[f"auto, {name}"] = SpeculativeEngine(t, d, make_policy("auto", gamma=d.default_gamma, progress=True))
prompts = load_bench_prompts(args.dataset, args.num_prompts)
greedy = SamplingParams()


def run(engine, text):
    ids = engine.target.encode_prompt(text)
    t0 = time.perf_counter()
    r = engine.generate(list(ids), max_new_tokens=args.max_new_tokens, sampling=greedy)
    return {"tokens": list(r.token_ids), "s": time.perf_counter() - t0, "passes": r.target_forward_passes}


for engine in engines.values():  # warm-up (and the auto policy's first calibration on this machine)
    run(engine, prompts[0].text)
names = list(engines)
rows = []
for i, p in enumerate(prompts):
    order = names[i % len(names):] + names[:i % len(names)]
    got = {name: run(engines[name], p.text) for name in order}
    ref = got["plain, fp32 head"]["tokens"]
    rows.append({"prompt": p.prompt_id, **{n: {"tokens": len(g["tokens"]), "s": round(g["s"], 3),
                                                "passes": g["passes"], "same_as_fp32_plain": g["tokens"] == ref}
                                            for n, g in got.items()}})
    print(p.prompt_id, "  ".join(f"{n} {len(g['tokens']) / g['s']:.1f} tok/s" for n, g in got.items()), flush=True)

summary = {}
for n in names:
    tokens = sum(r[n]["tokens"] for r in rows)
    secs = sum(r[n]["s"] for r in rows)
    summary[n] = {"tok_s": round(tokens / secs, 2), "tokens": tokens, "seconds": round(secs, 2),
                  "passes_per_prompt": round(sum(r[n]["passes"] for r in rows) / len(rows), 1),
                  "outputs_equal_to_fp32_plain": sum(r[n]["same_as_fp32_plain"] for r in rows)}
base = summary["plain, fp32 head"]["tok_s"]
for n in names:
    summary[n]["ratio_to_fp32_plain"] = round(summary[n]["tok_s"] / base, 3)
    print(f"{n:18s} {summary[n]}")
flags = subprocess.run("grep -o -w -E 'amx_bf16|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort -u",
                       shell=True, capture_output=True, text=True).stdout.split()
json.dump({"command": "python benchmarks/results/issue19_engine/scripts/bench_greedy_head.py " + " ".join(
              f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out") + f" {args.out}",
           "cpu_flags": flags, "torch": torch.__version__, "summary": summary, "rows": rows,
           "runtime": {n: t.runtime() for n, t in targets.items()}, "wall_s": round(time.time() - started)},
          open(args.out, "w"), indent=1)
