"""The Python that turns the fused call's layer outputs into the conditioned drafter's features, a pass (hot, 2000 calls each):
before: a list of 31 per-layer tensors, a tuple, then torch.cat of 3; after: llama_pass.LayerOutputs and rows_of (one gather).
    python ab_hidden_states.py"""
import statistics
import time

import torch

from diffspec.llama_pass import LayerOutputs

h = torch.randn(1, 1, 576); outputs = torch.randn(30, 1, 576); normed = torch.randn(1, 1, 576)
layers = (1, 14, 27)
def old():
    hidden = [h, *(outputs[i].unsqueeze(0) for i in range(outputs.shape[0]))]
    hidden[-1] = normed
    hs = tuple(hidden)
    return torch.cat([hs[i + 1][0, :1] for i in layers], dim=-1)
def new():
    hs = LayerOutputs(h, outputs); hs[-1] = normed
    return hs.rows_of(layers, 1)
assert torch.equal(old(), new())
for name, f in (("old", old), ("new", new)) * 2:
    ts = []
    for _ in range(2000):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    print(name, round(statistics.median(ts) * 1e6, 1), "us")
