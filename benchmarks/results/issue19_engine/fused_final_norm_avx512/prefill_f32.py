import time, torch, statistics
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
e = load_engine(drafter="none", backend="transformers", quiet=True)
t = e.target; fl = t.direct_pass.fused
calls = []
orig = fl.run
def run(h, *a, **k):
    r = orig(h, *a, **k); calls.append((h.shape[0], r is not None)); return r
fl.run = run
text = " ".join(p for _, p in load_prompts("humaneval")[:20])
ids = torch.tensor(t.encode_prompt(text, chat=False)[:1200])
for n in (64, 128, 200, 400):
    ts = []
    for rep in range(4):
        t.reset(); calls.clear()
        t0 = time.perf_counter(); t.prefill(ids[:n + 1], n + 50); ts.append(time.perf_counter() - t0)
    print(n, "rows: prefill", round(statistics.median(ts[1:]) * 1e3, 1), "ms", round(statistics.median(ts[1:]) * 1e3 / n, 2), "ms/row; fused calls", calls)
print(t.linear_plan.mm_rows)
