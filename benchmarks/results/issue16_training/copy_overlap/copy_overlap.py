"""Where is the shipped conditioned drafter right, and where would copying from the context be right?

At every anchor of the target's greedy answers (the eval-drafter continuations: 20 prompts a set, 256 tokens),
block 8 (7 drafted slots), this drafts with the shipped conditioned drafter and with prompt lookup through the same
calls (`evaluation.draft_at_anchors`) and counts, per set: slot-1 right for each, for both, for either (an oracle that
picks the right one of the two), lookup's share of anchors with a draft at all, and tau (block 8, bonus counted) for
each and for the per-anchor better of the two.

    python benchmarks/results/issue16_training/copy_overlap/copy_overlap.py OUT.json [--num-prompts 20]
"""
import argparse, json, sys, time

import torch

from diffspec.api import load_engine
from diffspec.drafter_names import make_drafter
from diffspec.evaluation import (anchor_positions, cached_continuations, draft_at_anchors, lookup_silent_at,
                                 render_set_prompts, truth_pass)

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=256)
ap.add_argument("--block-size", type=int, default=8)
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
args = ap.parse_args()

eng = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True)
target, cond = eng.target, eng.drafter
look = make_drafter("prompt-lookup", target)
look.attach(target)
cond.attach(target)
layers = tuple(cond.target_layer_ids)
B = args.block_size
result = {"block_size": B, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
          "drafters": {"conditioned": cond.describe(), "lookup": look.describe()}, "sets": {}}
t0 = time.perf_counter()
for s in args.sets:
    ids = render_set_prompts(target, s, args.num_prompts)
    conts = cached_continuations(target, s, ids, args.num_prompts, args.max_new_tokens, None, False,
                                 target.tokenizer_fingerprint)
    lc, ll, has = [], [], []
    for cont in conts:
        anchors = anchor_positions(cont.prompt_len, len(cont.ids), B)
        if not anchors:
            continue
        truth, hidden = truth_pass(target, cont.ids, layers)
        lc += draft_at_anchors(cond, cont, truth, hidden, anchors, B)
        ll += draft_at_anchors(look, cont, truth, None, anchors, B)
        has += [not quiet for quiet in lookup_silent_at(cont, anchors, B, look)]  # does lookup draft anything there?
    n = len(lc)
    c1 = [L >= 1 for L in lc]
    l1 = [L >= 1 for L in ll]
    row = {"anchors": n,
           "p1_conditioned": sum(c1) / n, "p1_lookup": sum(l1) / n,
           "p1_both": sum(a and b for a, b in zip(c1, l1)) / n,
           "p1_either": sum(a or b for a, b in zip(c1, l1)) / n,
           "lookup_drafts_share": sum(has) / n,
           "p1_lookup_where_it_drafts": sum(b for b, h in zip(l1, has) if h) / max(1, sum(has)),
           "p1_conditioned_where_lookup_drafts": sum(a for a, h in zip(c1, has) if h) / max(1, sum(has)),
           "p1_conditioned_where_lookup_does_not": sum(a for a, h in zip(c1, has) if not h) / max(1, n - sum(has)),
           "tau_conditioned": 1 + sum(lc) / n, "tau_lookup": 1 + sum(ll) / n,
           "tau_better_of_two": 1 + sum(max(a, b) for a, b in zip(lc, ll)) / n}
    result["sets"][s] = row
    print(s, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
result["wall_s"] = time.perf_counter() - t0
json.dump(result, open(args.out, "w"), indent=1)
