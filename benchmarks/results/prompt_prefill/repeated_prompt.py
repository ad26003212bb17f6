"""A repeated prompt on the default target (SmolLM2-135M-Instruct, transformers backend, --kernels auto, eager):
the request's prefill time and wall time when the target still holds the prompt's prefill, against the same request
after `target.reset()` (a new prefill), alternated, plain decoding of 16 new tokens, prompts of 64, 163 and 295
tokens (the text repeated 1, 4 and 8 times, in the chat template). Usage: python repeated_prompt.py OUT.json"""
import json
import statistics
import sys
import time

import torch

from diffspec import SpeculativeEngine, Target

target = Target.load(None, kernels="auto", quiet=True)
engine = SpeculativeEngine(target, None)
base = ("Explain, step by step and with examples, how a hash map handles collisions, how it grows, and what its "
        "operations cost on average and in the worst case. ")
rows = []
for repeats in (1, 4, 8):
    prompt = target.encode_prompt(base * repeats)
    engine.generate(prompt, max_new_tokens=4)  # warm-up
    runs = {"new prefill": [], "kept prefill": []}
    for turn in range(6):
        for kind in (("new prefill", "kept prefill") if turn % 2 == 0 else ("kept prefill", "new prefill")):
            if kind == "new prefill":
                target.reset()
            else:
                engine.generate(prompt, max_new_tokens=1)  # this prompt's prefill is the last one
            t0 = time.perf_counter()
            r = engine.generate(prompt, max_new_tokens=16, stop_token_ids=[])
            runs[kind].append({"wall_s": time.perf_counter() - t0, "prefill_s": r.prefill_time_s,
                               "prefill_passes": r.prefill_forward_passes, "ids": r.token_ids})
    ids = {tuple(x["ids"]) for v in runs.values() for x in v}
    row = {"prompt_tokens": len(prompt), "same_tokens_every_run": len(ids) == 1}
    for kind, v in runs.items():
        row[kind] = {"median_wall_s": round(statistics.median(x["wall_s"] for x in v), 4),
                     "median_prefill_s": round(statistics.median(x["prefill_s"] for x in v), 4),
                     "prefill_passes": sorted({x["prefill_passes"] for x in v})}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"threads": torch.get_num_threads(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
