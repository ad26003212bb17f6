"""The ceiling of speculation on a backend (issue 18): what a drafter that costs nothing and whose
drafted tokens are each right with probability `alpha` would give, by measurement, not by model.

For each prompt the target's plain greedy answer is decoded first; then a synthetic drafter proposes
that answer's next k tokens, each kept right with probability alpha and otherwise replaced by another
token (seeded), so the accepted prefix per round is geometric in alpha, capped at k. Its draft costs no
time: the throughput ratio over plain (same prompts, interleaved, the engine's real verify passes,
acceptance and rollback) is the most any drafter with that per-token acceptance can reach here.

    python benchmarks/speculation_ceiling.py OUT.json [--backend llama.cpp] [--dataset humaneval]
        [--num-prompts 10] [--max-new-tokens 256] [--alphas 1.0,0.9,0.7] [--ks 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from diffspec.backends import load_target
from diffspec.datasets import load_prompts
from diffspec.drafters.base import Drafter, DraftBuilder
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy


class SyntheticDrafter(Drafter):
    """Drafts the known answer's next tokens, each right with probability alpha (else answer + 1)."""

    name = "synthetic"

    def __init__(self, answer: list, vocab_size: int, alpha: float, seed: int = 0):
        self.answer, self.vocab_size, self.alpha = list(answer), vocab_size, alpha
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, context, policy, limit, sampling, generator):
        builder = DraftBuilder()
        rest = self.answer[len(context):]
        for k in builder.increments(policy, limit):
            for tok in rest[len(builder): len(builder) + k]:
                right = float(torch.rand((), generator=self.gen)) < self.alpha
                builder.add(tok if right else (tok + 1) % self.vocab_size, 1.0)
        return builder.build(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--backend", default="llama.cpp")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--alphas", default="1.0,0.9,0.7")
    ap.add_argument("--ks", default="1,2,4,8,16")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    target = load_target(None, backend=args.backend, quiet=True, drafters=("prompt-lookup",))
    prompts = load_prompts(args.dataset)[: args.num_prompts]
    plain = SpeculativeEngine(target, None, make_policy("fixed", gamma=1))
    configs = [(a, k) for a in alphas for k in ks]
    total = {"plain": [0, 0.0, 0, 0]}  # tokens, seconds, target passes, accepted drafts
    total.update({f"{a}/{k}": [0, 0.0, 0, 0] for a, k in configs})
    warm = target.encode_prompt(prompts[0][1])
    plain.generate(warm, max_new_tokens=16)
    for i, (pid, text) in enumerate(prompts):
        ids = target.encode_prompt(text)
        target.reset()  # every run prefills (a target keeps the last prompt's prefill otherwise)
        t0 = time.perf_counter()
        ref = plain.generate(ids, max_new_tokens=args.max_new_tokens)
        total["plain"][0] += len(ref.token_ids)
        total["plain"][1] += time.perf_counter() - t0
        total["plain"][2] += ref.target_forward_passes
        answer = ids + list(ref.token_ids)
        for a, k in configs:
            engine = SpeculativeEngine(target, SyntheticDrafter(answer, target.vocab_size, a, seed=i),
                                       make_policy("fixed", gamma=k))
            target.reset()
            t0 = time.perf_counter()
            got = engine.generate(ids, max_new_tokens=args.max_new_tokens)
            dt = time.perf_counter() - t0
            if got.token_ids != ref.token_ids:
                raise SystemExit(f"{pid}: alpha {a}, k {k}: output differs from plain (a lossless engine never does)")
            row = total[f"{a}/{k}"]
            row[0] += len(got.token_ids)
            row[1] += dt
            row[2] += got.target_forward_passes
            row[3] += got.accepted_tokens
        print(f"{i + 1}/{len(prompts)} {pid}", flush=True)
    base = total["plain"][0] / total["plain"][1]
    rows = []
    for a, k in configs:
        n, s, passes, acc = total[f"{a}/{k}"]
        rows.append({"alpha": a, "k": k, "throughput_ratio": round(n / s / base, 3), "tok_s": round(n / s, 1),
                     "target_passes_per_prompt": round(passes / len(prompts), 1),
                     "tokens_per_pass": round(n / passes, 2), "accepted_share": round(acc / n, 3)})
    print(f"plain {base:.1f} tok/s")
    print("alpha \\ k " + " ".join(f"{k:>6}" for k in ks))
    for a in alphas:
        print(f"{a:<9} " + " ".join(f"{r['throughput_ratio']:>5.2f}x" for r in rows if r["alpha"] == a))
    record = {"backend": target.backend, "dataset": args.dataset, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "plain_tok_s": round(base, 1),
              "plain_passes_per_prompt": round(total["plain"][2] / len(prompts), 1),
              "machine": platform.processor() or platform.machine(), "rows": rows,
              "command": "python benchmarks/speculation_ceiling.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out") + f" {args.out}"}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
