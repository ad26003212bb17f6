"""A/B: the direct pass with every layer in one C call (fused_layers.c) against its torch operations (llama_pass.py),
interleaved in one process on the default target (SmolLM2-135M, GGUF codes, --kernels auto).

    python benchmarks/results/issue19_engine/fused_layers/ab_fused.py OUT.json [--turns 5] [--reps 7]

For each context length and pass width: min and median over turns of the median of `reps` passes, each variant in
turn; plus the largest logit difference between the two and whether a wide pass equals one-row steps bitwise."""
import argparse, json, statistics, time

import torch

from diffspec.llama_pass import LlamaPass
from diffspec.machine_keys import machine_key
from diffspec.target import Target

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--turns", type=int, default=5)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
args = ap.parse_args()

target = Target.load(kernels="auto", quiet=True)
fused = target.direct_pass
torch_ops = LlamaPass(target.model, target.linear_plan, fused=False)
assert fused.fused is not None, "the fused layers do not apply here"
variants = {"torch ops": torch_ops, "fused": fused}
ids = torch.randint(100, 40000, (max(args.contexts) + max(args.widths) + 24,), generator=torch.Generator().manual_seed(0))

def timed(direct, ctx, width):
    target.direct_pass = direct
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
    # exactness: logits of both, and fused wide pass vs one-row steps
    logits, screen = {}, target.greedy_head
    target.greedy_head = None  # fp32 logits for every row (the screen computes them only where read)
    for name, direct in variants.items():
        target.direct_pass = direct
        target.reset(); target.reserve(ctx + 20)
        target.forward(ids[:ctx], logits=False)
        logits[name] = target.forward(ids[ctx:ctx + 16]).logits.clone()
    target.direct_pass = fused
    target.reset(); target.reserve(ctx + 20)
    target.forward(ids[:ctx], logits=False)
    steps = torch.cat([target.forward(ids[ctx + i:ctx + i + 1]).logits for i in range(16)])
    target.greedy_head = screen
    diff = (logits["fused"] - logits["torch ops"]).abs().max().item()
    same_argmax = bool(torch.equal(logits["fused"].argmax(-1), logits["torch ops"].argmax(-1)))
    invariant = bool(torch.equal(steps, logits["fused"]))
    for width in args.widths:
        timed(fused, ctx, width); timed(torch_ops, ctx, width)  # warm-up
        turns = {name: [] for name in variants}
        for _ in range(args.turns):
            for name, direct in variants.items():
                turns[name].append(timed(direct, ctx, width) * 1e3)
        row = {"context": ctx, "width": width,
               **{f"{name} ms min": round(min(v), 3) for name, v in turns.items()},
               **{f"{name} ms median": round(statistics.median(v), 3) for name, v in turns.items()}}
        row["speedup (min)"] = round(row["torch ops ms min"] / row["fused ms min"], 3)
        results.append(row)
        print(row, flush=True)
    print({"context": ctx, "max |logit diff| fused vs torch ops (16 rows)": diff, "same argmax": same_argmax,
           "16-row pass == 16 one-row steps bitwise": invariant}, flush=True)
    results.append({"context": ctx, "max_logit_diff": diff, "same_argmax_16_rows": same_argmax,
                    "wide_pass_equals_one_row_steps_bitwise": invariant})
json.dump({"machine": machine_key("cpu"), "threads": torch.get_num_threads(), "runtime": target.runtime(),
           "results": results}, open(args.out, "w"), indent=1)
