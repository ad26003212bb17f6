"""torch.compile (inductor, dynamic=True) of the transformers target's whole forward, our position-indexed
cache and --kernels auto traced in, for one plain step at a 256-token context: compile time, the step's
time against eager (interleaved, median of 15), and the largest logit difference."""
import time

import torch

from diffspec.target import Target

torch.set_num_threads(2)
t = Target.load(None, kernels="auto", quiet=True)
ids = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(0))
t.reset()
t.reserve(600)
t.forward(ids, logits=False)
eager = t.model.forward
compiled = torch.compile(t.model.forward, dynamic=True)


def step(fn):
    tok = torch.tensor([[5]])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn(input_ids=tok, past_key_values=t._cache, use_cache=True, logits_to_keep=0)
    dt = time.perf_counter() - t0
    t.truncate(256)
    return dt, out.logits


t0 = time.perf_counter()
_, lc = step(compiled)
print(f"first compiled call (compiling): {time.perf_counter() - t0:.1f} s")
_, le = step(eager)
print(f"largest logit difference compiled vs eager: {(lc - le).abs().max().item():.2e}")
a, c = [], []
for _ in range(15):
    a.append(step(eager)[0])
    c.append(step(compiled)[0])
print(f"one step: eager {sorted(a)[7] * 1e3:.1f} ms, compiled {sorted(c)[7] * 1e3:.1f} ms")
