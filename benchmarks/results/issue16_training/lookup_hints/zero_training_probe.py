"""Zero-training probe: the shipped conditioned drafter with prompt lookup's draft written into its block
(slots the lookup fills carry that token instead of the mask) against the masks alone, at every anchor of the
target's greedy answers (eval-drafter continuations), block 8. Greedy leading matches -> p1, tau."""
import json, sys, time
import torch
from diffspec.api import load_engine
from diffspec.drafter_names import make_drafter
from diffspec.evaluation import anchor_positions, cached_continuations, render_set_prompts, truth_pass, leading_matches
from diffspec.policies import FixedPolicy
from diffspec.types import SamplingParams

sets = sys.argv[1].split(",") if len(sys.argv) > 1 else ["humaneval"]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10
B = 8
eng = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True)
target, cond = eng.target, eng.drafter
look = make_drafter("prompt-lookup", target); look.attach(target); cond.attach(target)
layers = tuple(cond.target_layer_ids)
print(cond.describe(), cond.cfg.block_size)

@torch.inference_mode()
def logits_with_block(d, context, hints):
    cfg = d.cfg
    anchor = context.shape[0] - 1
    weights = d._weights.current(d.model); d._flush(weights)
    dtype = next(d.model.parameters()).dtype
    block = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
    block[0] = context[-1]
    for i, h in enumerate(hints[:cfg.block_size - 1]):
        block[i + 1] = h
    d._cache.reserve(anchor + cfg.block_size)
    cos, sin = d._rope.rows(anchor, cfg.block_size, dtype, context.device)
    hidden = d._compile_module()(weights, d._cache, d._embed(block).to(dtype), cos, sin)
    from diffspec.drafters.conditioned_pass import matmul
    return matmul(hidden[1:].to(d._head_weight.dtype), d._head_matrix)

out = {}
for s in sets:
    ids_ = render_set_prompts(target, s, N)
    conts = cached_continuations(target, s, ids_, N, 256, None, False, target.tokenizer_fingerprint)
    res = {"mask": [], "hint": [], "lookup": [], "lookup_then_drafter": [], "has": []}
    slots = cond.cfg.block_size - 1
    for cont in conts:
        anchors = anchor_positions(cont.prompt_len, len(cont.ids), cond.cfg.block_size)
        if not anchors: continue
        truth, hidden = truth_pass(target, cont.ids, layers)
        truth = truth.tolist()
        ids = torch.tensor(cont.ids)
        cond.begin(ids[:cont.prompt_len]); look.begin(ids[:cont.prompt_len])
        seen = 0
        for a in anchors:
            if a > seen:
                cond.observe(hidden[seen:a], seen); seen = a
            ctx = ids[:a + 1]
            lk = look.propose(ctx, FixedPolicy(slots), slots, SamplingParams(), None).tokens[:slots].tolist()
            want = truth[a:a + slots]
            m = cond.model.to_target_ids(logits_with_block(cond, ctx, []).argmax(-1)).tolist()
            h = cond.model.to_target_ids(logits_with_block(cond, ctx, lk).argmax(-1)).tolist() if lk else m
            res["mask"].append(leading_matches(m, want))
            res["hint"].append(leading_matches(h, want))
            res["lookup"].append(leading_matches(lk, want) if lk else 0)
            res["lookup_then_drafter"].append(leading_matches(lk + m[len(lk):], want))
            res["has"].append(bool(lk))
    n = len(res["mask"])
    row = {"anchors": n, "lookup_drafts_share": sum(res["has"]) / n}
    for k in ("mask", "hint", "lookup", "lookup_then_drafter"):
        L = res[k]
        row[k] = {"p1": sum(x >= 1 for x in L) / n, "tau": 1 + sum(L) / n,
                  "p1_where_lookup_drafts": sum(x >= 1 for x, h in zip(L, res["has"]) if h) / max(1, sum(res["has"])),
                  "p1_where_silent": sum(x >= 1 for x, h in zip(L, res["has"]) if not h) / max(1, n - sum(res["has"]))}
    out[s] = row
    print(s, json.dumps(row), flush=True)
