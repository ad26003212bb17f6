"""In-process A/B of fused_layers.c's attention scores: "vsum" = -DATTEND_TRANSPOSED=0 (each position's score summed alone,
four positions side by side, as before), "transposed" = the default (SCORE_BLOCK positions a step, one transposing sum
vsum_lanes, bitwise vsum). Pass + logits by rows at a context of real text; variants and rows interleaved, 25 of 30.
    python score_blocks_ab.py KERNELS CONTEXT [CONTEXT ...]"""
import statistics, sys, time, torch
from diffspec import fused_layers as FL
from diffspec.packed_linear import NATIVE
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
kernels = sys.argv[1]
AVX2 = ("-mavx2", "-mfma", "-mf16c")
variants = {"vsum": AVX2 + ("-DATTEND_TRANSPOSED=0",), "transposed": AVX2}
libs = {k: FL.build_library(f) for k, f in variants.items()}
e = load_engine(drafter="none", backend="transformers", kernels=kernels, quiet=True)
t = e.target; fl = t.direct_pass.fused
text = " ".join(p for _, p in load_prompts("humaneval")[:30])
ids = torch.tensor(t.encode_prompt(text, chat=False)[:2100])
rows = (1, 2, 3, 5, 8)
for ctx in [int(c) for c in sys.argv[2:]]:
    t.reset(); t.prefill(ids[:ctx], ctx + 64)
    res, same = {}, True
    for rep in range(30):
        for n in rows:
            got = {}
            for k in (list(variants) if rep % 2 else list(variants)[::-1]):
                fl.lib = libs[k]
                t0 = time.perf_counter(); got[k] = t.forward(ids[ctx:ctx + n]).logits; dt = time.perf_counter() - t0
                t.truncate(ctx)
                if rep >= 5: res.setdefault((n, k), []).append(dt * 1e3)
            same &= torch.equal(got["vsum"], got["transposed"])
    print(f"{kernels} context {ctx}: " + "  ".join(
        f"n{n} {statistics.median(res[(n, 'vsum')]):.3f}->{statistics.median(res[(n, 'transposed')]):.3f} "
        f"({statistics.median(res[(n, 'transposed')]) / statistics.median(res[(n, 'vsum')]):.3f})" for n in rows)
        + f"  same logits bitwise: {same}", flush=True)
