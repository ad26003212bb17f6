"""Under sampling, should the conditioned drafter draw its block's tokens from q, or draft q's argmax (judged one-hot)?

Rejection sampling is exact either way. Slot 1's acceptance probability at an anchor, with p the target's distribution
there and q the drafter's (both at the request's temperature): sum_x min(p(x), q(x)) when the token is drawn from q
(verified against q), p(argmax q) when q's argmax is drafted (verified one-hot). Measured exactly (expectations, no
draws) at every anchor of the target's answers (eval-drafter's cached greedy continuations: 20 prompts a set, 128
tokens), with the shipped drafter and the target's own distribution at each anchor; greedy p1 beside it.

    python benchmarks/results/issue16_training/sampling_drafts/slot1_sampling.py OUT.json [--temperatures 0.7 1.0]
"""
import argparse, json, time

import torch

from diffspec.api import load_engine
from diffspec.evaluation import anchor_positions, cached_continuations, render_set_prompts
from diffspec.policies import FixedPolicy
from diffspec.sampling import probs_from_logits
from diffspec.types import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--num-prompts", type=int, default=20)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench", "champ"])
args = ap.parse_args()

eng = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True)
target, cond = eng.target, eng.drafter
cond.attach(target)
layers = tuple(cond.target_layer_ids)
B = cond.cfg.block_size
result = {"drafter": cond.describe(), "block_size": B, "num_prompts": args.num_prompts,
          "max_new_tokens": args.max_new_tokens, "sets": {}}
t0 = time.perf_counter()
for s in args.sets:
    ids = render_set_prompts(target, s, args.num_prompts)
    conts = cached_continuations(target, s, ids, args.num_prompts, args.max_new_tokens, None, False,
                                 target.tokenizer_fingerprint)
    sums = {T: {"drawn": 0.0, "argmax": 0.0} for T in args.temperatures}
    greedy_right, n = 0, 0
    for cont in conts:
        anchors = anchor_positions(cont.prompt_len, len(cont.ids), B)
        if not anchors:
            continue
        seq = torch.tensor(cont.ids, dtype=torch.long)
        target.reset()
        with torch.inference_mode():
            out = target.forward(seq, hidden_layers=layers)
        target.reset()
        logits, hidden = out.logits.float(), out.hidden_states
        cond.begin(seq[:cont.prompt_len])
        seen = 0
        for a in anchors:
            if a > seen:
                cond.observe(hidden[seen:a], seen)
                seen = a
            greedy = cond.propose(seq[:a + 1], FixedPolicy(1), 1, SamplingParams(), None)
            greedy_right += int(greedy.tokens[0]) == int(logits[a].argmax())
            for T in args.temperatures:
                sp = SamplingParams(temperature=T)
                q = cond.propose(seq[:a + 1], FixedPolicy(1), 1, sp, torch.Generator().manual_seed(0)).probs[0].double()
                p = probs_from_logits(logits[a:a + 1], sp)[0].double()
                sums[T]["drawn"] += float(torch.minimum(p, q).sum())
                sums[T]["argmax"] += float(p[int(q.argmax())])
            n += 1
    row = {"anchors": n, "greedy_p1": greedy_right / n}
    for T in args.temperatures:
        row[f"T{T}"] = {"drawn_from_q": sums[T]["drawn"] / n, "argmax_one_hot": sums[T]["argmax"] / n}
    result["sets"][s] = row
    print(s, json.dumps(row), flush=True)
result["wall_s"] = round(time.perf_counter() - t0, 1)
json.dump(result, open(args.out, "w"), indent=1)
