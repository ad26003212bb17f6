"""What a plain step through the direct pass (llama_pass.py) spends its time on, on the default target
(--kernels auto), at a 256-token context: the step as it is, with the packed kernel's calls replaced by empty
outputs, with SDPA replaced by an empty output, and with both (interleaved, 5 turns of the median of 25 steps;
min and median over turns). Then two references: one SDPA call of a layer's shape at this context with its keys
and values hot in cache and cold (40 MB streamed between calls), and MKL's float32 GEMM on 2048 x 2048 (the CPU's
practical multiply-add peak).

    python benchmarks/results/issue19_engine/scripts/direct_step_parts.py > OUT.txt
"""
import statistics
import time

import torch
import torch.nn.functional as F

from diffspec import kernels as K
from diffspec import llama_pass as LP
from diffspec.target import Target

torch.set_num_threads(2)
t = Target.load(None, quiet=True, kernels="auto")
assert t.direct_pass is not None
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
t.reset()
t.reserve(400)
t.forward(ids[:256], logits=False)


def step():
    t.forward(ids[256:257]).greedy_tokens()
    t.truncate(256)


real_kernel, real_sdpa, real_packed = LP._run_kernel, F.scaled_dot_product_attention, K.packed_linear
empty_kernel = lambda x, codes, *a, **kw: torch.zeros((*x.shape[:-1], codes.shape[0]))
empty_packed = lambda x, w, bias=None: torch.zeros((*x.shape[:-1], w.shape[0]))
empty_sdpa = lambda q, k, v, **kw: torch.zeros_like(q)
modes = {"step": (real_kernel, real_sdpa, real_packed), "without the packed kernel": (empty_kernel, real_sdpa, empty_packed),
         "without SDPA": (real_kernel, empty_sdpa, real_packed), "without either": (empty_kernel, empty_sdpa, empty_packed)}
res = {}
for _ in range(5):
    for name, (kernel, sdpa, packed) in modes.items():
        LP._run_kernel, F.scaled_dot_product_attention, K.packed_linear = kernel, sdpa, packed
        for _ in range(5):
            step()
        ts = []
        for _ in range(25):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        res.setdefault(name, []).append(statistics.median(ts) * 1e3)
LP._run_kernel, F.scaled_dot_product_attention, K.packed_linear = real_kernel, real_sdpa, real_packed
print("one-row step through the direct pass, 256-token context, ms (min / median over 5 turns):")
for name, v in res.items():
    print(f"  {name}: {min(v):.2f} / {statistics.median(v):.2f}")

cfg = t.model.config
D = cfg.hidden_size // cfg.num_attention_heads
keys = torch.randn(1, cfg.num_key_value_heads, 400, D)[:, :, :257]
values = torch.randn(1, cfg.num_key_value_heads, 400, D)[:, :, :257]
q = torch.randn(1, cfg.num_attention_heads, 1, D)
flush = torch.randn(10 * 2**20)
for label, cold in (("hot", False), ("cold", True)):
    ts = []
    for _ in range(300):
        if cold:
            flush.add_(1.0)
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, enable_gqa=True)
        ts.append(time.perf_counter() - t0)
    print(f"SDPA, one query row over 257 positions ({cfg.num_attention_heads} heads on {cfg.num_key_value_heads}), "
          f"keys and values {label}: median {statistics.median(ts) * 1e6:.1f} us")
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
a @ b
ts = []
for _ in range(10):
    t0 = time.perf_counter()
    a @ b
    ts.append(time.perf_counter() - t0)
print(f"MKL float32 GEMM 2048^3: {2 * 2048 ** 3 / min(ts) / 1e9:.0f} GFLOP/s ({2048 ** 3 / min(ts) / 1e9:.0f} GMAC/s)")
