"""A lead for the screened greedy head at 1-4 rows (greedy_head.py takes bf16 only from 3 rows here):
the 49152 x 576 head as torch's int8 weight-only kernel (`torch._weight_int8pack_mm`, per-row scales),
with fp32 and with bf16 activations, against the bf16 product. Random weights at SmolLM2's scale;
median of 11 after a warm-up; ms.

    python benchmarks/results/issue19_engine/scripts/head_int8_microbench.py
"""
import torch

from diffspec.timing import median_ms

torch.set_num_threads(2)
V, H = 49152, 576
W = torch.randn(V, H) * 0.13
s = W.abs().amax(dim=1) / 127
q = torch.round(W / s[:, None]).clamp(-127, 127).to(torch.int8)
Wb, Wf = W.bfloat16(), W


def tm(f):
    return median_ms(f, repeats=11, warmup=1)


for r in [1, 2, 4, 8, 16, 32]:
    x = torch.randn(r, H)
    xb, x2 = x.bfloat16(), (torch.cat([x, x]) if r == 1 else x)
    print(f"rows {r:2d}: fp32 mm(W, x^T) {tm(lambda: torch.mm(Wf, x2.t())):6.2f}  "
          f"bf16 linear {tm(lambda: torch.nn.functional.linear(xb, Wb)):6.2f}  "
          f"int8, bf16 activations {tm(lambda: torch._weight_int8pack_mm(xb, q, s.bfloat16())):6.2f}  "
          f"int8, fp32 activations {tm(lambda: torch._weight_int8pack_mm(x, q, s)):7.2f}", flush=True)
