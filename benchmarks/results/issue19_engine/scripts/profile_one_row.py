"""torch.profiler over 20 one-row steps (plain decoding) at a 256-token context, after a median over 30.

    python benchmarks/results/issue19_engine/scripts/profile_one_row.py off|auto   (the --compile mode)
"""
import sys, time, torch
from torch.profiler import profile
from diffspec.target import Target
torch.set_num_threads(2)
mode = sys.argv[1]
t = Target.load(None, quiet=True, kernels="auto", compile=mode)
print(t.runtime().get("compile"), flush=True)
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
t.reset(); t.reserve(400); t.forward(ids[:256], logits=False)
pos = 256
def step():
    global pos
    t.forward(ids[pos:pos + 1]).greedy_tokens(); pos += 1
for _ in range(10): step()
ts = []
for _ in range(30):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
print("median one-row ms", sorted(ts)[15] * 1e3)
with profile() as p:
    for _ in range(20): step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
