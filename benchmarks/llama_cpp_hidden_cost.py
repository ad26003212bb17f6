"""What reading hidden states costs a llama.cpp verify pass (issue 18): the pass of 1 + k tokens after
a context, plain against with the conditioned drafter's layers read (the eval-callback context),
interleaved in one process: per turn, each variant prefills the context and times every k.

    python benchmarks/llama_cpp_hidden_cost.py OUT.json [--context 256] [--layers 1,14,27] [--turns 3]

Prints and writes ms per pass (min over turns of the median of --reps) and the ratio."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from diffspec.backends.llama_cpp import LlamaCppTarget

KS = (0, 1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", default="1,14,27")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    layers = tuple(int(x) for x in args.layers.split(","))
    target = LlamaCppTarget.load(None, quiet=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.context + max(KS) + 1,), generator=gen)
    best = {v: {k: float("inf") for k in KS} for v in ("plain", "hidden")}
    for _ in range(args.turns):
        for variant, hl in (("plain", ()), ("hidden", layers)):
            target.reset()
            target.forward(ids[:args.context], hidden_layers=hl, logits=False)
            for k in KS:
                times = []
                for _ in range(args.reps + 1):
                    t0 = time.perf_counter()
                    target.forward(ids[args.context: args.context + k + 1], hidden_layers=hl)
                    times.append(time.perf_counter() - t0)
                    target.truncate(args.context)
                best[variant][k] = min(best[variant][k], statistics.median(times[1:]) * 1e3)
    target.reset()
    rows = [{"k": k, "plain_ms": round(best["plain"][k], 2), "hidden_ms": round(best["hidden"][k], 2),
             "ratio": round(best["hidden"][k] / best["plain"][k], 3)} for k in KS]
    for r in rows:
        print(r)
    record = {"context": args.context, "layers": list(layers), "threads": target.threads, "turns": args.turns,
              "reps": args.reps, "machine": platform.processor() or platform.machine(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
