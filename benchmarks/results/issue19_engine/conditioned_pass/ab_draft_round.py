"""A/B, one process, interleaved: a conditioned drafter's draft round (the features of 1 + accepted positions
turned into context keys/values, then the block pass and the head), the reference module pass that
ConditionedDrafter ran up to 52bd839 ("before": context_keys_values + torch.cat per round, model.forward,
torch matmuls) against the lean pass (conditioned_pass.py, bf16_linear's kernel where the model is bf16).

    python benchmarks/results/issue19_engine/conditioned_pass/ab_draft_round.py [--drafter DIR] [--accepted 2]
        [--contexts 100 300 1000] [--turns 7] [--steps 40]

Random features (the cost does not depend on their values); the shipped SmolLM2 drafter by default, in the
dtype its attach chose on this machine. Prints min and median over turns of each turn's median step (ms).
"""
import argparse
import json
import statistics
import time

import torch

from diffspec.api import load_engine

ap = argparse.ArgumentParser()
ap.add_argument("--drafter", default="conditioned")
ap.add_argument("--accepted", type=int, default=2, help="positions observed per round (1 + accepted tokens)")
ap.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1000])
ap.add_argument("--turns", type=int, default=7)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--json")
args = ap.parse_args()

drafter = load_engine(drafter=args.drafter, policy="fixed", backend="transformers", kernels="auto", quiet=True).drafter
model, cfg = drafter.model, drafter.cfg
dtype = next(model.parameters()).dtype
print(drafter.describe(), "| torch threads", torch.get_num_threads())
g = torch.Generator().manual_seed(0)
total = max(args.contexts) + args.accepted * (args.steps + 2) + 1
features = torch.randn(total, model.fc.in_features, generator=g).to(dtype)
tokens = torch.randint(0, 1000, (total,), generator=g)


class Before:
    """The reference module pass, as ConditionedDrafter.block_logits ran it before the lean pass."""

    def begin(self, n0):
        self.kv, self.n = model.context_keys_values(features[:n0], torch.arange(n0)), n0

    def step(self, m):
        new = model.context_keys_values(features[self.n:self.n + m], torch.arange(self.n, self.n + m))
        self.kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.n += m
        block = torch.full((cfg.block_size,), cfg.mask_token_id)
        block[0] = tokens[self.n]
        hidden = model(drafter._embed(block).to(dtype), torch.arange(self.n, self.n + cfg.block_size), self.kv)
        return hidden[1:].to(drafter._head_weight.dtype) @ drafter._head_weight.T


class Lean:
    def begin(self, n0):
        drafter.begin(None)
        drafter.observe(features[:n0], 0)
        drafter._flush()

    def step(self, m):
        n = drafter._context_len
        drafter.observe(features[n:n + m], n)
        return drafter.block_logits(tokens[:n + m + 1])


rows = []
with torch.inference_mode():
    for n0 in args.contexts:
        times = {"before": [], "lean": []}
        for _ in range(args.turns):
            for name, impl in (("before", Before()), ("lean", Lean())):
                impl.begin(n0)
                ts = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    impl.step(args.accepted)
                    ts.append((time.perf_counter() - t) * 1e3)
                times[name].append(statistics.median(ts[5:]))
        a, b = Before(), Lean()
        a.begin(n0), b.begin(n0)
        la, lb = a.step(args.accepted).float(), b.step(args.accepted).float()
        row = {"context": n0, **{f"{k}_min_ms": round(min(v), 3) for k, v in times.items()},
               **{f"{k}_median_ms": round(statistics.median(v), 3) for k, v in times.items()},
               "max_abs_logit_diff": round((la - lb).abs().max().item(), 4),
               "argmax_agree": round((la.argmax(-1) == lb.argmax(-1)).float().mean().item(), 3)}
        row["speedup_min"] = round(row["before_min_ms"] / row["lean_min_ms"], 2)
        rows.append(row)
        print(json.dumps(row))
if args.json:
    with open(args.json, "w") as f:
        json.dump({"drafter": drafter.describe(), "args": vars(args), "rows": rows}, f, indent=1)
