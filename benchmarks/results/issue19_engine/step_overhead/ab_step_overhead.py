"""A/B, one process, interleaved: the Python around the fused layers' C call, before and after this change.

before: FusedLayers._packs asks each of the 120 linear groups for its pack every pass (packed_for: each checks its
        layers' `forward` and `packed_weight`), and PositionalLayer.advance cuts 60 key/value views a step;
after:  the packs are kept with packed_linear's routing epoch, and the views are cut when read.

Both variants run the same C call on the same packs (outputs compared bitwise). Two measures:
  steps:  one-row steps (and 2-row verify passes) at a context of 256, median of each turn, min over turns;
  plain:  plain greedy decoding of --num-prompts HumanEval prompts x --max-new-tokens, the variants alternating
          prompt by prompt (and which goes first alternating), throughput = total tokens / total time.

    python ab_step_overhead.py [--turns 7] [--steps 60] [--num-prompts 10] [--max-new-tokens 256] [--json OUT]
"""
import argparse
import json
import statistics
import time

import torch

import diffspec.fused_layers as FL
from diffspec.cache import PositionalLayer
from diffspec.datasets import load_prompts
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.target import Target

ap = argparse.ArgumentParser()
ap.add_argument("--turns", type=int, default=7)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--num-prompts", type=int, default=10)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--json")
args = ap.parse_args()


def packs_before(self, rows):
    packs = []
    for layer in self.layers:
        for group in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj):
            pack = group.packed_for(rows)
            if pack is None:
                return None
            packs.append(pack)
    return packs


def advance_before(self, n):
    if self.length + n > self.capacity:
        raise ValueError("past capacity")
    self.length += n
    self._view()


variants = {"before": (packs_before, advance_before), "after": (FL.FusedLayers._packs, PositionalLayer.advance)}


def use(name):
    FL.FusedLayers._packs, PositionalLayer.advance = variants[name]


target = Target.load(kernels="auto", quiet=True)
print(target.runtime() if hasattr(target, "runtime") else "", "| torch threads", torch.get_num_threads(), flush=True)
ids = torch.randint(100, 40000, (256 + args.steps + 8,), generator=torch.Generator().manual_seed(0))

result = {"steps": {}, "plain": {}}
for width in (1, 2):
    times = {v: [] for v in variants}
    outs = {}
    for turn in range(args.turns):
        for name in (variants if turn % 2 == 0 else list(variants)[::-1]):
            use(name)
            target.reset()
            target.reserve(256 + args.steps * width + 8)
            target.forward(ids[:256], logits=False)
            ts, last = [], None
            for i in range(args.steps):
                x = ids[256 + i: 256 + i + width]
                t0 = time.perf_counter()
                out = target.forward(x)
                out.greedy_tokens()
                ts.append(time.perf_counter() - t0)
                target.truncate(256 + i + 1)  # one row kept a step, as a round with its draft rejected
                last = out.logits
            times[name].append(statistics.median(ts[5:]) * 1e3)
            outs[name] = last
    same = torch.equal(outs["before"], outs["after"])
    result["steps"][f"rows_{width}"] = {**{f"{v}_min_ms": round(min(t), 3) for v, t in times.items()},
                                         **{f"{v}_median_ms": round(statistics.median(t), 3) for v, t in times.items()},
                                         "speedup_median": round(statistics.median(times["before"]) /
                                                                 statistics.median(times["after"]), 3),
                                         "logits_bitwise_equal": same}
    print(f"{width}-row passes", json.dumps(result["steps"][f"rows_{width}"]), flush=True)

engine = SpeculativeEngine(target, None, make_policy("fixed", gamma=1))
prompts = load_prompts("humaneval")[: args.num_prompts]
totals = {v: [0, 0.0] for v in variants}
tokens_of = {v: [] for v in variants}
use("after")
engine.generate(target.encode_prompt(prompts[0][1]), max_new_tokens=16)  # warm-up
for i, (pid, text) in enumerate(prompts):
    prompt = target.encode_prompt(text)
    for name in (variants if i % 2 == 0 else list(variants)[::-1]):
        use(name)
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
        totals[name][1] += time.perf_counter() - t0
        totals[name][0] += len(out.token_ids)
        tokens_of[name].append(out.token_ids)
use("after")
for name, (n, s) in totals.items():
    result["plain"][f"{name}_tok_s"] = round(n / s, 2)
result["plain"]["throughput_ratio"] = round(result["plain"]["after_tok_s"] / result["plain"]["before_tok_s"], 3)
result["plain"]["outputs_identical"] = tokens_of["before"] == tokens_of["after"]
print("plain decoding", json.dumps(result["plain"]), flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), **result}, f, indent=1)
