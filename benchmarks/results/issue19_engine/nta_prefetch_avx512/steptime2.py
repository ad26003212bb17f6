"""Where a one-row step goes: medians of each part over 2 HumanEval prompts x 256 tokens of plain decoding.
    python steptime2.py [KERNELS]      (default q8; `auto`: the float32 target)"""
import sys, time, statistics, collections
import torch, torch.nn.functional as F
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec import llama_pass as LP
acc = collections.defaultdict(list)
def timed(label, f):
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[label].append(1e3 * (time.perf_counter() - t0)); return r
    return g
prompts = [t for _, t in load_prompts("humaneval")[:2]]
e = load_engine(drafter="none", backend="transformers", kernels=sys.argv[1] if len(sys.argv) > 1 else "q8", quiet=True)
e.generate(prompts[0], max_new_tokens=8)
dp = e.target.direct_pass
F.rms_norm = timed("rms_norm", F.rms_norm)
F.embedding = timed("embedding", F.embedding)
dp.rotary.forward = timed("rotary", dp.rotary.forward)
LP.LlamaPass.forward = timed("LlamaPass.forward", LP.LlamaPass.forward)
dp.fused.run = timed("fused.run", dp.fused.run)
dp.head.forward = timed("head.forward", dp.head.forward)
acc.clear()
for p in prompts:
    e.target.reset(); r = e.generate(p, max_new_tokens=256)
for k, v in acc.items():
    print(f"{k:22s} n={len(v):4d} median {statistics.median(v):.3f} ms")
x = torch.randn(1, 1, 576); w = torch.ones(576)
for _ in range(3):
    t0 = time.perf_counter(); 
    for _ in range(1000): F.rms_norm(x, (576,), w, 1e-5)
    print("rms_norm hot", (time.perf_counter() - t0), "ms per call")
