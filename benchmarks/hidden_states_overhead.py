"""One-token target passes with and without the conditioned drafter's hidden states (layers 1, 14, 27),
interleaved 150 times: median and mean ms. Issue 17: does the combined default slow rounds it sits out?"""
import time, torch, statistics
from diffspec.target import Target
t = Target.load(None)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, t.vocab_size, (150,), generator=g)
t.reset(); t.forward(ids[:100])
L = 100
res = {"plain": [], "hidden": []}
for it in range(150):
    for name, layers in (("plain", ()), ("hidden", (1, 14, 27))):
        x = ids[100 + (it % 50): 101 + (it % 50)]
        t0 = time.perf_counter(); t.forward(x, hidden_layers=layers); res[name].append(time.perf_counter() - t0)
        t.truncate(L)
print({k: (round(statistics.median(v)*1000, 2), round(statistics.mean(v)*1000, 2)) for k, v in res.items()})
