"""A/B, interleaved per prompt in one process: ConditionedDrafter.propose as at 39f800c (the head over every row of the
block, then the policy's rows) against the working tree's (the head on the rows the policy takes). Same engine, same
prompts; outputs must be identical (greedy).  python ab_propose.py DRAFTER POLICY[,gamma=G] [prompts] [turns]"""
import sys, time, json, statistics, subprocess
import torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec.drafters import conditioned
from diffspec.drafters.base import DraftBuilder, align_logits_to_vocab, draw_tokens

@torch.inference_mode()
def old_propose(self, context, policy, limit, sampling, generator):  # 39f800c's
    cfg = self.cfg
    logits = self.block_logits(context)
    if not cfg.draft_vocab:
        logits = align_logits_to_vocab(logits, self.vocab_size)
    drawn = draw_tokens(logits, sampling, generator)
    conf, q = drawn.token_prob, drawn.q
    if q is not None and cfg.draft_vocab:
        q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.model.draft_token_ids, q)
    tokens = self.model.to_target_ids(drawn.tokens)
    builder = DraftBuilder()
    for k in builder.increments(policy, limit):
        for i in range(len(builder), min(len(builder) + k, self.max_tokens_per_round)):
            builder.add(int(tokens[i]), float(conf[i]), None if q is None else q[i])
    return builder.build(1, context.device)

new_propose = conditioned.ConditionedDrafter.propose
drafter, pol = sys.argv[1], sys.argv[2]
nprompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
turns = int(sys.argv[4]) if len(sys.argv) > 4 else 2
opts = dict(kv.split("=") for kv in pol.split(",")[1:])
opts = {k: int(v) for k, v in opts.items()}
eng = load_engine(drafter=drafter, policy=pol.split(",")[0], backend="transformers", kernels="auto", quiet=True,
                  drafter_dtype="q8", **opts)
print(eng.drafter.describe(), eng.policy.describe())
prompts = [t for _, t in load_prompts("humaneval")[:nprompts]]
res = {"old": [], "new": []}
for which, f in (("old", old_propose), ("new", new_propose)):  # warm-up
    conditioned.ConditionedDrafter.propose = f
    eng.generate(prompts[0], max_new_tokens=32)
outs = {}
for turn in range(turns):
    for i, p in enumerate(prompts):
        for which, f in ((("old", old_propose), ("new", new_propose)) if (turn + i) % 2 == 0 else
                         (("new", new_propose), ("old", old_propose))):
            conditioned.ConditionedDrafter.propose = f
            eng.target.reset()
            t = time.perf_counter()
            r = eng.generate(p, max_new_tokens=256)
            wall = time.perf_counter() - t
            outs.setdefault((i, which), r.token_ids)
            drafted = [s for s in r.rounds if s.drafted or s.draft_time_s > 0]
            res[which].append(dict(wall=wall, tokens=len(r.token_ids), rounds=len(r.rounds),
                                   draft_ms=1e3 * sum(s.draft_time_s for s in r.rounds) / max(1, len(drafted)),
                                   drafter_rounds=len(drafted)))
same = all(outs[(i, "old")] == outs[(i, "new")] for i in range(len(prompts)))
out = {"drafter": drafter, "policy": pol, "identical_outputs": same}
for w, v in res.items():
    out[w] = dict(tok_s=sum(x["tokens"] for x in v) / sum(x["wall"] for x in v),
                  draft_ms_per_drafter_round=statistics.median(x["draft_ms"] for x in v),
                  drafter_rounds=sum(x["drafter_rounds"] for x in v), rounds=sum(x["rounds"] for x in v))
out["new_over_old"] = out["new"]["tok_s"] / out["old"]["tok_s"]
print(json.dumps(out, indent=1))
if len(sys.argv) > 5:
    json.dump(out, open(sys.argv[5], "w"), indent=1)
