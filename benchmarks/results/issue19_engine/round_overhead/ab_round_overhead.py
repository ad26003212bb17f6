"""Old and new per-round Python around the target's pass, interleaved in one process, same engine and prompts.

"old" puts back, by monkeypatching, what this session changed: torch's argmax for the greedy choice (now
packed_linear.argmax_rows), PositionalLayer.crop/reset cutting their views at once (now when next read), and the
text decoded incrementally every round inside generate (now once at the end). Methods: plain decoding and the
default's prompt lookup under the auto policy, HumanEval prompts x 256 tokens, transformers backend, kernels auto.
Per prompt and method the two variants run back to back in alternating order; outputs must be equal.

    python benchmarks/results/issue19_engine/round_overhead/ab_round_overhead.py OUT.json [--prompts 10] [--reps 2]
"""
import argparse, json, time

import torch

from diffspec.api import load_engine
from diffspec.bench.prompts import load_bench_prompts
from diffspec.cache import PositionalLayer
from diffspec.target import TargetOutput

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--prompts", type=int, default=10)
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--max-new-tokens", type=int, default=256)
args = ap.parse_args()

new = {"greedy": TargetOutput.greedy_tokens, "crop": PositionalLayer.crop, "reset": PositionalLayer.reset}


def old_greedy(self):
    if self._logits is None:
        return self.head.tokens(self.final_hidden)
    return self._logits.argmax(dim=-1)


def old_crop(self, tokens_to_remove):
    new["crop"](self, tokens_to_remove)
    if self.is_initialized and tokens_to_remove:
        self._view()


def old_reset(self):
    new["reset"](self)
    if self.is_initialized:
        self._view()


def set_variant(v):
    TargetOutput.greedy_tokens = new["greedy"] if v == "new" else old_greedy
    PositionalLayer.crop = new["crop"] if v == "new" else old_crop
    PositionalLayer.reset = new["reset"] if v == "new" else old_reset


def run(engine, prompt, v):
    set_variant(v)
    t = time.perf_counter()
    if v == "new":
        r = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
    else:
        s = engine.stream(prompt, max_new_tokens=args.max_new_tokens)
        for _ in s:
            pass
        r = s.result
    return time.perf_counter() - t, r


prompts = [p.text for p in load_bench_prompts("humaneval", args.prompts)]
engines = {"plain": load_engine(drafter=None, policy="fixed", backend="transformers", kernels="auto", quiet=True),
           "prompt-lookup:auto": load_engine(drafter="prompt-lookup", policy="auto", backend="transformers",
                                             kernels="auto", quiet=True)}
for e in engines.values():  # warm-up
    for v in ("old", "new"):
        run(e, prompts[0], v)
rows = []
for rep in range(args.reps):
    for i, p in enumerate(prompts):
        for m, e in engines.items():
            order = ("old", "new") if (rep + i) % 2 == 0 else ("new", "old")
            res = {v: run(e, p, v) for v in order}
            assert res["old"][1].token_ids == res["new"][1].token_ids and res["old"][1].text == res["new"][1].text
            rows.append({"rep": rep, "prompt": i, "method": m, "tokens": len(res["new"][1].token_ids),
                         "rounds": res["new"][1].num_rounds, "old_s": res["old"][0], "new_s": res["new"][0]})
summary = {}
for m in engines:
    r = [x for x in rows if x["method"] == m]
    toks = sum(x["tokens"] for x in r)
    old, new_ = sum(x["old_s"] for x in r), sum(x["new_s"] for x in r)
    ratios = sorted(x["old_s"] / x["new_s"] for x in r)
    summary[m] = {"tokens": toks, "rounds": sum(x["rounds"] for x in r), "old_tok_s": toks / old,
                  "new_tok_s": toks / new_, "throughput_ratio_new_over_old": old / new_,
                  "median_pair_ratio": ratios[len(ratios) // 2],
                  "ms_saved_per_round": 1e3 * (old - new_) / sum(x["rounds"] for x in r)}
    print(m, json.dumps({k: round(v, 4) for k, v in summary[m].items()}), flush=True)
json.dump({"summary": summary, "rows": rows, "threads": torch.get_num_threads()}, open(args.out, "w"), indent=1)
