"""The screened greedy head (greedy_head.py) against the fp32 head, one verify pass over k drafted tokens
(k = 0: a plain decoding step) at a 256-token context, `--kernels auto`, in one process: the two
interleaved per turn (3 turns), median of 5 passes per turn, min over the turns. A pass is timed as
the engine reads it: the forward, then each row's greedy choice (`TargetOutput.greedy_tokens()`).
Each pass's choices are checked equal between the two (and to the float64 argmax of the head).

    python benchmarks/results/issue19_engine/scripts/ab_greedy_head.py OUT.json [--compile on] [--ks 0 3 7 15]
        [--context random|answer]  (random tokens, or the target's own greedy answer to HumanEval/0)
"""
import argparse
import json
import platform
import subprocess
import time

import torch

from diffspec.greedy_head import exact_argmax
from diffspec.target import Target

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--compile", default="off")
ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 31])
ap.add_argument("--turns", type=int, default=3)
ap.add_argument("--context", choices=["random", "answer"], default="random")
args = ap.parse_args()

torch.set_num_threads(2)
t = Target.load(None, quiet=False, kernels="auto", compile=args.compile)
screen = t.greedy_head
assert screen is not None, t.runtime()["greedy_head"]
print("plan:", t.linear_plan.describe(), flush=True)
ctx = 256
if args.context == "random":  # random tokens: flat next-token distributions, many candidates (the worst case)
    ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
else:  # the target's own greedy answer to HumanEval/0: the distributions verification meets
    from diffspec.bench.prompts import load_bench_prompts
    from diffspec.engine import SpeculativeEngine
    prompt = t.encode_prompt(load_bench_prompts("humaneval", 1)[0].text)
    answer = SpeculativeEngine(t, None).generate(prompt, max_new_tokens=400 - len(prompt), stop_token_ids=[]).token_ids
    ids = torch.tensor(prompt + list(answer))
    assert len(ids) >= ctx + 33, len(ids)


def measure(k, reps=5):
    t.reset()
    t.reserve(ctx + 80)
    t.forward(ids[:ctx], logits=False)
    ts, choice = [], None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out = t.forward(ids[ctx:ctx + k + 1])
        choice = out.greedy_tokens()
        ts.append(time.perf_counter() - t0)
        t.truncate(ctx)
    ts = sorted(ts[1:])
    return ts[len(ts) // 2] * 1e3, choice, out


res, agree = {}, {}
for k in args.ks:
    row, choices = {}, {}
    for _ in range(args.turns):
        for mode in ("fp32 head", "screened"):
            t.greedy_head = screen if mode == "screened" else None
            ms, choices[mode], out = measure(k)
            row.setdefault(mode, []).append(ms)
            if mode == "screened" and out.final_hidden is not None:
                assert torch.equal(choices[mode], exact_argmax(out.final_hidden, screen.weight))
    agree[k] = bool(torch.equal(choices["fp32 head"], choices["screened"]))
    res[k] = {m: round(min(v), 2) for m, v in row.items()}
    print(f"k {k:2d}: " + "  ".join(f"{m} {v:6.1f}" for m, v in res[k].items())
          + f"   x{res[k]['fp32 head'] / res[k]['screened']:.2f}  same choices {agree[k]}", flush=True)
t.greedy_head = screen
flags = subprocess.run("grep -o -w -E 'amx_bf16|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort -u",
                       shell=True, capture_output=True, text=True).stdout.split()
json.dump({"context": ctx, "context_tokens": args.context, "compile": args.compile, "ms": res, "same_choices": agree, "cpu_flags": flags,
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "runtime": t.runtime(), "plan_head_timings_us": t.linear_plan.timings_us.get("greedy_head")},
          open(args.out, "w"), indent=1)
