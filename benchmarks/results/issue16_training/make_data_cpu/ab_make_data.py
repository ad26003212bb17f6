"""make-data's batched generation on a CPU, before and after (issue 16, item 1): the same real prompts (the store's
own order: ShareGPT user turns with their context, <= 256 tokens, a chunk sorted by length, batches of 64),
answered by both settings alternately, batch by batch, in one process:
  before: decode_step="model" (transformers' forward, SDPA), prefill groups of 16,384 tokens (the old defaults)
  after:  decode_step="direct" (batch_step's step, attention by fused_layers.c), prefill groups of 4,096
Usage: python ab_make_data.py OUT.json [PROMPTS] [BATCH]"""
import json
import platform
import sys
import time

import torch

from diffspec.target import Target
from diffspec.training.data import drop_evaluation_overlap, evaluation_prompts, load_corpus
from diffspec.training.store import generate_batch, ordered_prompts

out_path = sys.argv[1]
n_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 256
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
target = Target.load(None, quiet=True)
convs, _ = drop_evaluation_overlap(load_corpus("sharegpt"), evaluation_prompts())
order = ordered_prompts(convs, target.tokenizer, 256, 0, limit=n_prompts, progress=False)
prompts = order.prompts[:n_prompts]
by_length = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
stop = frozenset(int(s) for s in target.stop_token_ids)
pad = target.tokenizer.pad_token_id or 0
SETTINGS = {"before": dict(decode_step="model", prefill_tokens=16384),
            "after": dict(decode_step="direct", prefill_tokens=4096)}
# warm-up: one small batch each
for kw in SETTINGS.values():
    generate_batch(target.model, [prompts[i] for i in by_length[:4]], 8, stop, pad, **kw)
rows, answers = [], {k: {} for k in SETTINGS}
for b0 in range(0, len(by_length), batch):
    idx = by_length[b0: b0 + batch]
    for name in (("before", "after") if (b0 // batch) % 2 == 0 else ("after", "before")):
        t0 = time.perf_counter()
        resp = generate_batch(target.model, [prompts[i] for i in idx], 192, stop, pad, **SETTINGS[name])
        seconds = time.perf_counter() - t0
        for i, r in zip(idx, resp):
            answers[name][i] = r
        gen = sum(map(len, resp))
        rows.append({"batch": b0 // batch, "method": name, "prompt_tokens": sum(len(prompts[i]) for i in idx),
                     "generated": gen, "seconds": round(seconds, 2), "tokens_per_s": round(gen / seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
total = {k: {"generated": sum(r["generated"] for r in rows if r["method"] == k),
             "seconds": round(sum(r["seconds"] for r in rows if r["method"] == k), 2)} for k in SETTINGS}
for v in total.values():
    v["tokens_per_s"] = round(v["generated"] / v["seconds"], 1)
same = sum(answers["before"][i] == answers["after"][i] for i in answers["before"])
result = {"prompts": len(prompts), "batch": batch, "max_new_tokens": 192, "settings": SETTINGS, "rows": rows,
          "total": total, "ratio": round(total["after"]["tokens_per_s"] / total["before"]["tokens_per_s"], 3),
          "answers_identical": f"{same}/{len(prompts)}",
          "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "flags": sorted({f for f in open("/proc/cpuinfo").read().split()
                                       if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})}}
json.dump(result, open(out_path, "w"), indent=1)
print(json.dumps({k: result[k] for k in ("total", "ratio", "answers_identical")}))
