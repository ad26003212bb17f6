"""A/B, one process, interleaved: one denoising step of a block-diffusion drafter in bf16 (a block of 16 on
a cache of 64-512 positions; `_time_step`) with its linear layers on the measured plan's torch matmuls
("before", 3b1549b) against bf16_linear's kernel (now). The drafter is shaped as
issue16_training/block16_avx512's (the target's architecture cut to 2 layers, block 16, draft vocabulary
8192), with random weights: a step's cost does not depend on them.

    python benchmarks/results/issue19_engine/block_bf16_kernel/ab_block_step.py [--json out.json]
"""
import argparse
import json
import statistics

import torch
from transformers import LlamaForCausalLM

from diffspec import kernels
from diffspec.api import load_engine
from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy

ap = argparse.ArgumentParser()
ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512])
ap.add_argument("--turns", type=int, default=7)
ap.add_argument("--json")
args = ap.parse_args()

target = load_engine(drafter=None, policy="fixed", backend="transformers", kernels="auto", quiet=True).target
cfg = target.model.config.__class__.from_dict({**target.model.config.to_dict(), "num_hidden_layers": 2,
                                                "vocab_size": target.vocab_size + 1, "tie_word_embeddings": True})
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
drafter = BlockDiffusionDrafter(model, BlockDiffusionConfig(mask_token_id=target.vocab_size, block_size=16),
                                target.tokenizer_fingerprint, draft_token_ids=torch.arange(8192))
drafter.compute_dtype = "bfloat16"
SpeculativeEngine(target, drafter, make_policy("fixed", gamma=15))  # attaches: bf16, plan, bf16 kernel
linears = [m for m in drafter.model.modules() if isinstance(m, torch.nn.Linear)]
kernel_forwards = [m.__dict__["forward"] for m in linears]
kernels.install(drafter.model, kernels.plan_for_mode(drafter.model, "auto", quiet=True))
plan_forwards = [m.__dict__.get("forward") for m in linears]
print(drafter.describe(), "| routed to the kernel:", sum(f is not None for f in kernel_forwards), "layers")


def use(forwards):
    for m, f in zip(linears, forwards):
        if f is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = f


rows = []
for ctx in args.contexts:
    t = {"before": [], "kernel": []}
    for _ in range(args.turns):
        for name, forwards in (("before", plan_forwards), ("kernel", kernel_forwards)):
            use(forwards)
            t[name].append(drafter._time_step(context_len=ctx, repeats=15))
    row = {"context": ctx, **{f"{k}_min_ms": round(min(v), 3) for k, v in t.items()},
           **{f"{k}_median_ms": round(statistics.median(v), 3) for k, v in t.items()}}
    row["speedup_min"] = round(row["before_min_ms"] / row["kernel_min_ms"], 2)
    rows.append(row)
    print(json.dumps(row))
use(kernel_forwards)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"drafter": drafter.describe(), "rows": rows}, f, indent=1)
