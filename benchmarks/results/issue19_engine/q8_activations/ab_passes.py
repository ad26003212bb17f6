"""A/B: target passes under `--kernels q8` (8-bit activations, q8_linear.c) against `--kernels auto` (float32
products, the default), interleaved in one process on the default target (SmolLM2-135M, GGUF codes).

    python benchmarks/results/issue19_engine/q8_activations/ab_passes.py OUT.json [--turns 5] [--reps 7]

For each context length and pass width: min and median over turns of the median of `reps` passes (each pass:
the target's forward over `width` new rows and its greedy choices, then the cache truncated back), the two targets
in turn. Also, per context: whether q8's 16-row pass equals 16 one-row steps bitwise, and how far its logits are
from the float32 ones (largest difference, and the share of rows whose argmax differs)."""
import argparse, json, statistics, time

import torch

from diffspec.machine_keys import machine_key
from diffspec.target import Target

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--turns", type=int, default=5)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48])
args = ap.parse_args()

targets = {"auto": Target.load(kernels="auto", quiet=True), "q8": Target.load(kernels="q8", quiet=True)}
ids = torch.randint(100, 40000, (max(args.contexts) + max(args.widths) + 24,), generator=torch.Generator().manual_seed(0))


def timed(target, ctx, width):
    target.reset(); target.reserve(ctx + width + 1)
    target.forward(ids[:ctx], logits=False)
    out = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        o = target.forward(ids[ctx:ctx + width])
        o.greedy_tokens()
        out.append(time.perf_counter() - t0)
        target.truncate(ctx)
    return statistics.median(out)


results = []
for ctx in args.contexts:
    logits = {}
    for name, target in targets.items():
        screen, target.greedy_head = target.greedy_head, None  # fp32 logits of every row
        target.reset(); target.reserve(ctx + 20)
        target.forward(ids[:ctx], logits=False)
        logits[name] = target.forward(ids[ctx:ctx + 16]).logits.clone()
        target.greedy_head = screen
    q8 = targets["q8"]
    q8.reset(); q8.reserve(ctx + 20)
    q8.forward(ids[:ctx], logits=False)
    steps = torch.cat([q8.forward(ids[ctx + i:ctx + i + 1]).logits for i in range(16)], dim=-2)
    check = {"context": ctx, "q8 16-row pass == 16 one-row steps bitwise": bool(torch.equal(steps, logits["q8"])),
             "max |logit diff| q8 vs float32": (logits["q8"] - logits["auto"]).abs().max().item(),
             "rows whose argmax differs (of 16)": int((logits["q8"].argmax(-1) != logits["auto"].argmax(-1)).sum())}
    print(check, flush=True)
    results.append(check)
    for width in args.widths:
        for t in targets.values():
            timed(t, ctx, width)  # warm-up
        turns = {name: [] for name in targets}
        for _ in range(args.turns):
            for name, t in targets.items():
                turns[name].append(timed(t, ctx, width) * 1e3)
        row = {"context": ctx, "width": width,
               **{f"{name} ms min": round(min(v), 3) for name, v in turns.items()},
               **{f"{name} ms median": round(statistics.median(v), 3) for name, v in turns.items()}}
        row["q8 speedup (min)"] = round(row["auto ms min"] / row["q8 ms min"], 3)
        results.append(row)
        print(row, flush=True)
json.dump({"machine": machine_key("cpu"), "threads": torch.get_num_threads(),
           "runtime": {n: t.runtime() for n, t in targets.items()}, "results": results}, open(args.out, "w"), indent=1)
