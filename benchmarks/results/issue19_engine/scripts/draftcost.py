"""Block-diffusion drafting cost per round (the trained 2-layer drafter), fixed draft lengths."""
import sys, time, json, torch
from diffspec.api import load_engine
torch.set_num_threads(2)
prompts = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain why the sky is blue in three sentences.",
           "List the first ten prime numbers and say how you found them."]
out = {}
for gamma in (4, 8, 15):
    eng = load_engine(None, drafter="/work/runs/block/drafter", policy="fixed", gamma=gamma, backend="transformers", quiet=True)
    eng.generate(prompts[0], max_new_tokens=16)  # warm-up
    d = r = p = 0.0
    for text in prompts:
        res = eng.generate(text, max_new_tokens=64)
        for s in res.rounds:
            if s.drafted:
                d += s.draft_time_s; r += 1; p += s.drafter_forward_passes
    out[gamma] = {"draft_ms_per_round": round(d / r * 1e3, 2), "drafter_passes_per_round": round(p / r, 2), "rounds": int(r)}
    print(gamma, out[gamma], flush=True)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
