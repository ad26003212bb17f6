"""A/B (tried and not kept, sixth session): the fused layers' attention reading each key and value once for the
query heads that share it (shared_kv_attention.patch applied to src/diffspec/fused_layers.c) against one head at a
time (fused_layers.c at a166a98, as kept), interleaved in one process on the default target (SmolLM2-135M: 9 query
heads on 3 key-value heads, head dim 64, GGUF codes, --kernels auto).

    git show a166a98:src/diffspec/fused_layers.c | sed 's#"packed_linear.c"#"'$PWD'/src/diffspec/packed_linear.c"#' > OLD.c
    git apply benchmarks/results/issue19_engine/fused_layers/microbench/shared_kv_attention.patch
    python benchmarks/results/issue19_engine/fused_layers/microbench/ab_attention.py OLD.c OUT.json [--turns 5] [--reps 7]
    git checkout src/diffspec/fused_layers.c

For each context length and pass width: min and median over turns of the median of `reps` passes (logits of the
rows the engine reads: greedy tokens), each variant in turn; and whether the two give bitwise the same logits."""
import argparse, copy, json, statistics, time
from pathlib import Path

import torch

import diffspec.fused_layers as fl
from diffspec.machine_keys import machine_key
from diffspec.packed_linear import NATIVE, KernelUnavailable
from diffspec.target import Target

ap = argparse.ArgumentParser()
ap.add_argument("old_source")
ap.add_argument("out")
ap.add_argument("--turns", type=int, default=5)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
ap.add_argument("--widths", type=int, nargs="+", default=[1, 8, 16, 24, 32])
args = ap.parse_args()

target = Target.load(kernels="auto", quiet=True)
new = target.direct_pass.fused
assert new is not None, "the fused layers do not apply here"
source = fl.SOURCE
fl.SOURCE = Path(args.old_source)
old_lib = fl.build_library.__wrapped__(NATIVE)
fl.SOURCE = source
assert not isinstance(old_lib, KernelUnavailable), old_lib
old = copy.copy(new)
old.lib = old_lib
variants = {"a166a98": old, "shared keys/values": new}
ids = torch.randint(100, 40000, (max(args.contexts) + max(args.widths) + 24,), generator=torch.Generator().manual_seed(0))


def run(fused, ctx, width, reps):
    target.direct_pass.fused = fused
    target.reset(); target.reserve(ctx + width + 1)
    target.forward(ids[:ctx], logits=False)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        o = target.forward(ids[ctx:ctx + width])
        o.greedy_tokens()
        out.append(time.perf_counter() - t0)
        target.truncate(ctx)
    return statistics.median(out)


results = []
for ctx in args.contexts:
    logits, screen = {}, target.greedy_head
    target.greedy_head = None  # float32 logits of every row
    for name, fused in variants.items():
        target.direct_pass.fused = fused
        target.reset(); target.reserve(ctx + 40)
        target.forward(ids[:ctx], logits=False)
        logits[name] = target.forward(ids[ctx:ctx + 32]).logits.clone()
    target.greedy_head = screen
    same = bool(torch.equal(*logits.values()))
    print({"context": ctx, "32-row logits bitwise equal": same}, flush=True)
    results.append({"context": ctx, "logits_bitwise_equal_32_rows": same})
    for width in args.widths:
        for fused in variants.values():
            run(fused, ctx, width, 2)  # warm-up
        turns = {name: [] for name in variants}
        for _ in range(args.turns):
            for name, fused in variants.items():
                turns[name].append(run(fused, ctx, width, args.reps) * 1e3)
        row = {"context": ctx, "width": width,
               **{f"{name} ms min": round(min(v), 3) for name, v in turns.items()},
               **{f"{name} ms median": round(statistics.median(v), 3) for name, v in turns.items()}}
        row["speedup (min)"] = round(row["a166a98 ms min"] / row["shared keys/values ms min"], 3)
        results.append(row)
        print(row, flush=True)
target.direct_pass.fused = new
json.dump({"machine": machine_key("cpu"), "threads": torch.get_num_threads(), "runtime": target.runtime(),
           "results": results}, open(args.out, "w"), indent=1)
