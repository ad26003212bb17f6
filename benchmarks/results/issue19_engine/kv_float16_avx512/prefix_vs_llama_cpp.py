"""Where greedy tokens part (2026-11-30): the q8 target with a float32 cache, with a float16 cache (the default under
--kernels q8 now), and llama.cpp's own decoding of the same GGUF (its cache float16). Per prompt: the common prefix
of each pair, in tokens. python prefix_vs_llama_cpp.py PROMPTS_PER_SET MAX_NEW_TOKENS"""
import json, statistics, sys
import torch
from diffspec.api import load_engine
from diffspec.datasets import load_prompts

per_set, new = int(sys.argv[1]), int(sys.argv[2])
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
ll = load_engine(drafter="none", backend="llama.cpp", quiet=True)
t = e.target


def prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


rows = []
for s in ("humaneval", "mtbench", "champ"):
    for pid, text in load_prompts(s)[:per_set]:
        out = {}
        for k, v in (("f32", None), ("f16", torch.float16)):
            t.kv_storage = v; t.reset()
            out[k] = e.generate(text, max_new_tokens=new).token_ids
        ll.target.reset()
        out["llama.cpp"] = ll.generate(text, max_new_tokens=new).token_ids
        rows.append({"set": s, "prompt": pid, "f32_vs_f16": prefix(out["f32"], out["f16"]),
                     "f32_vs_llama_cpp": prefix(out["f32"], out["llama.cpp"]),
                     "f16_vs_llama_cpp": prefix(out["f16"], out["llama.cpp"]),
                     "lengths": [len(out["f32"]), len(out["f16"]), len(out["llama.cpp"])]})
        print(json.dumps(rows[-1]), flush=True)
summary = {k: {"median": statistics.median(r[k] for r in rows), "whole": sum(r[k] >= min(r["lengths"]) for r in rows)}
           for k in ("f32_vs_f16", "f32_vs_llama_cpp", "f16_vs_llama_cpp")}
print(json.dumps({"prompts": len(rows), "max_new_tokens": new, "common_prefix": summary}))
