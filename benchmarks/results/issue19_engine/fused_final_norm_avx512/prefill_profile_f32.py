import torch
from torch.profiler import profile, ProfilerActivity
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
e = load_engine(drafter="none", backend="transformers", quiet=True)
t = e.target
text = " ".join(p for _, p in load_prompts("humaneval")[:20])
ids = torch.tensor(t.encode_prompt(text, chat=False)[:1200])
for _ in range(2):
    t.reset(); t.prefill(ids[:201], 250)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        t.reset(); t.prefill(ids[:201], 250)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
