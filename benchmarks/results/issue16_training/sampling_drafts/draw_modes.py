"""Drafts drawn from q, or q's argmax judged one-hot, at temperature > 0: the whole round, not slot 1 only.
The shipped conditioned drafter, fixed draft length G, T, 128 tokens a prompt, seeded; per mode: emitted tokens a round
(bonus counted), the rate at which slot j is accepted once reached, target passes. Modes interleaved per prompt."""
import json, sys, time, collections
import torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec.drafters import conditioned as C
from diffspec.drafters.base import DrawnTokens
from diffspec.types import SamplingParams
G, T, n = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
orig_draw, orig_init = C.draw_tokens, C._DrawnRows.__init__
mode = ["drawn"]
def draw(logits, sampling, generator):
    if mode[0] == "drawn" or sampling.greedy:
        return orig_draw(logits, sampling, generator)
    q = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    p, tok = q.max(dim=-1)
    return DrawnTokens(tok, p, p, None)
def init(self, *a, **k):
    orig_init(self, *a, **k)
    if mode[0] == "argmax": self.q = None
C.draw_tokens, C._DrawnRows.__init__ = draw, init
e = load_engine(drafter="conditioned", policy="fixed", gamma=G, backend="transformers", quiet=True)
prompts = [t for ds in ("humaneval", "mtbench", "champ") for _, t in load_prompts(ds)[:n]]
stats = {m: collections.Counter() for m in ("drawn", "argmax")}
reached = {m: collections.Counter() for m in stats}; acc = {m: collections.Counter() for m in stats}
for i, p in enumerate(prompts):
    for m in (("drawn", "argmax") if i % 2 == 0 else ("argmax", "drawn")):
        mode[0] = m
        r = e.generate(p, max_new_tokens=128, sampling=SamplingParams(temperature=T, seed=1000 + i))
        for s in r.rounds:
            if s.drafted == 0: continue
            stats[m]["rounds"] += 1; stats[m]["emitted"] += s.emitted; stats[m]["accepted"] += s.accepted
            for j in range(1, s.drafted + 1):
                if s.accepted >= j - 1: reached[m][j] += 1
                if s.accepted >= j: acc[m][j] += 1
        stats[m]["tokens"] += len(r.token_ids); stats[m]["passes"] += r.target_forward_passes
out = {"G": G, "T": T, "prompts": len(prompts), "max_new_tokens": 128, "drafter": e.drafter.describe()}
for m in stats:
    s = stats[m]
    out[m] = {"rounds": s["rounds"], "emitted_per_round": round(s["emitted"] / s["rounds"], 3),
              "tokens_per_target_pass": round(s["tokens"] / s["passes"], 3),
              "slot_acceptance_when_reached": {j: round(acc[m][j] / reached[m][j], 3) for j in sorted(reached[m])}}
print(json.dumps(out))
