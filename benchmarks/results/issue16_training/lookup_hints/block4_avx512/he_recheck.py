import time, sys
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
ps = dict(load_prompts("humaneval")[:20])
ids = sys.argv[1].split(",")
plain = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
cond = load_engine(drafter="/work/runs27/hints4/drafter", policy="auto", backend="transformers", kernels="q8", quiet=True, target=plain.target) if False else None
from diffspec.api import load_engine as le
cond = le(drafter="/work/runs27/hints4/drafter", policy="auto", backend="transformers", kernels="q8", quiet=True)
for rep in range(3):
    for name, e in (("plain", plain), ("cond", cond)):
        for i in ids:
            p = ps["HumanEval/" + i]
            e.target.reset() if hasattr(e.target, "reset") else None
            r = e.generate(p, max_new_tokens=256)
            rs = r.rounds
            print(rep, name, i, len(r.token_ids), f"wall {r.wall_time_s:.3f} verify {sum(s.verify_time_s for s in rs):.3f} draft {sum(s.draft_time_s for s in rs):.3f} hs {sum(s.hidden_states for s in rs)} pre {r.prefill_time_s:.3f}", flush=True)
