"""Plain decoding's tokens with the final norm in the fused call ("new") against the torch norm ("old", the code whose
tokens equal transformers' generate on all 60 bench prompts, README "Exactness"), over the bench's 60 prompts x 256
tokens, float32 target (--kernels auto). python same_tokens_60.py [KERNELS]"""
import json, sys
from diffspec.api import load_engine
from diffspec.datasets import load_prompts

kernels = sys.argv[1] if len(sys.argv) > 1 else "auto"
e = load_engine(drafter="none", backend="transformers", kernels=kernels, quiet=True)
dp = e.target.direct_pass
norm = dp.fused.final_norm
assert norm is not None
same, differ = 0, []
for s in ("humaneval", "mtbench", "champ"):
    for pid, text in load_prompts(s)[:20]:
        got = {}
        for v in ("old", "new"):
            dp.fused.final_norm = norm if v == "new" else None
            e.target.reset()
            got[v] = e.generate(text, max_new_tokens=256).token_ids
        if got["old"] == got["new"]:
            same += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(got["old"], got["new"])) if a != b), None)
            differ.append({"set": s, "prompt": pid, "first_difference": first})
print(json.dumps({"kernels": kernels, "prompts": 60, "same_tokens": same, "differ": differ}))
