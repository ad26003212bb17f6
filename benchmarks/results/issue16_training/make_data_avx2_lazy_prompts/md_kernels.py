"""make-data's store building under a target of --kernels K, for a time budget: python md_kernels.py K SECONDS OUT"""
import sys, time, json
from diffspec.target import Target
from diffspec.training.data import load_corpus
from diffspec.training.store import build_store
k, secs, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
t = Target.load(None, quiet=True, kernels=k)
convs = load_corpus("sharegpt")
m = build_store(out, t, convs, max_new_tokens=192, max_prompt_tokens=256, batch_size=64, deadline=time.time() + secs,
                progress=False, corpus="sharegpt")
print(k, json.dumps({x: m[x] for x in ("prompts_done", "generated_tokens_total", "generation_seconds", "generated_tokens_per_s")}),
      m["settings"].get("decode_step"), m["settings"].get("decode_step_choice"))
