"""In-process A/B of builds of the fused call's library (fused_layers.c compiled with other -D flags or ISA flags):
one target, each pass timed under every build in turn, the builds' order alternating, by rows at a context of real
text (HumanEval prompts, no chat template, concatenated). The A/B scripts under benchmarks/results/ that compare
builds call `pass_curve` (earlier ones keep the loop inline, as they ran).

    from build_ab import pass_curve
    pass_curve("q8", {"before": NATIVE + ("-DX=0",), "after": NATIVE}, contexts=(400, 1024))

Prints a line per context: each row count's median pass time (ms) under the first build -> the second, their ratio,
and whether every pass gave the same output (logits bitwise, or the greedy tokens) under both.
"""
import statistics
import time

import torch

from diffspec import fused_layers as FL
from diffspec.api import load_engine
from diffspec.datasets import load_prompts


def pass_curve(kernels: str, variants: dict, contexts, rows=(1, 2, 3, 5, 8), read: str = "logits",
               reps: int = 30, warmup: int = 5, label: str = "") -> None:
    """`variants`: two names -> compiler flags for fused_layers.c; `read`: "logits" or "greedy" (what each pass
    computes after its layers, and what is compared)."""
    (a, b) = variants
    libs = {k: FL.build_library(flags) for k, flags in variants.items()}
    e = load_engine(drafter="none", backend="transformers", kernels=kernels, quiet=True)
    t = e.target
    fused = t.direct_pass.fused
    text = " ".join(p for _, p in load_prompts("humaneval")[:30])
    ids = torch.tensor(t.encode_prompt(text, chat=False)[:2100])
    for ctx in contexts:
        t.reset()
        t.prefill(ids[:ctx], ctx + 64)
        res, same = {}, True
        for rep in range(reps):
            for n in rows:
                got = {}
                for k in ((a, b) if rep % 2 else (b, a)):
                    fused.lib = libs[k]
                    t0 = time.perf_counter()
                    out = t.forward(ids[ctx:ctx + n])
                    got[k] = out.logits if read == "logits" else out.greedy_tokens()
                    dt = time.perf_counter() - t0
                    t.truncate(ctx)
                    if rep >= warmup:
                        res.setdefault((n, k), []).append(dt * 1e3)
                same &= torch.equal(got[a], got[b])
        med = {key: statistics.median(v) for key, v in res.items()}
        print(f"{label}context {ctx}: " + "  ".join(
            f"n{n} {med[(n, a)]:.3f}->{med[(n, b)]:.3f} ({med[(n, b)] / med[(n, a)]:.3f})" for n in rows)
            + ("  same logits bitwise: " if read == "logits" else "  same greedy tokens: ") + str(same), flush=True)
