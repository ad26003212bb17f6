"""How often a plain one-row step's greedy choice is not provably the exact argmax (kernels.unscreened_where_packed).

Plain greedy decoding of the default target (packed head, one-row steps); at every step, the tokens whose fp32 logit
lies within greedy_head's fp32 bound of the best (greedy_head.candidates with fp32_bound_factors): where there are
two or more, the packed kernel's fp32 argmax and the argmax of the exact dot products may differ (the screened head
chose the latter at its widths). Also counted: the steps where they did differ (float64 products of the step's
normed last hidden state with the fp32 head).

    python near_ties_plain.py [--humaneval 10] [--mtbench 5] [--max-new-tokens 256]
"""
import argparse
import json

import torch

import diffspec.llama_pass as LP
from diffspec.backends import load_target
from diffspec.datasets import load_prompts
from diffspec.engine import SpeculativeEngine
from diffspec.greedy_head import candidates, fp32_bound_factors
from diffspec.policies import make_policy

ap = argparse.ArgumentParser()
ap.add_argument("--humaneval", type=int, default=10)
ap.add_argument("--mtbench", type=int, default=5)
ap.add_argument("--max-new-tokens", type=int, default=256)
args = ap.parse_args()

target = load_target(None, backend="transformers", quiet=True, drafters=("prompt-lookup",))
W = target.model.get_output_embeddings().weight.detach()
row_norms = W.norm(dim=-1)
stats = {"steps": 0, "steps_with_2_or_more_candidates": 0, "steps_where_fp32_and_exact_argmax_differ": 0}
original = LP.LlamaPass._head


def observed(self, last, hidden, keep):
    out = original(self, last, hidden, keep)
    h = LP._rms_norm(last, self.norm)[0]
    if isinstance(keep, int) and keep:
        h = h[-keep:]
    if out.logits.shape[1] == h.shape[0] == 1:  # one-row steps (the prefill keeps its last row too: counted)
        logits = out.logits[0]
        rows, _ = candidates(logits, h.norm(dim=-1), row_norms, *fp32_bound_factors(h.shape[-1]))
        stats["steps"] += 1
        stats["steps_with_2_or_more_candidates"] += int(rows.numel() > 1)
        exact = (h.double() @ W.double().t()).argmax(-1)
        stats["steps_where_fp32_and_exact_argmax_differ"] += int((exact != logits.argmax(-1)).sum())
    return out


LP.LlamaPass._head = observed
plain = SpeculativeEngine(target, None, make_policy("fixed", gamma=1))
prompts = load_prompts("humaneval")[: args.humaneval] + load_prompts("mtbench")[: args.mtbench]
for pid, text in prompts:
    plain.generate(target.encode_prompt(text), max_new_tokens=args.max_new_tokens)
print(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, **stats}))
