import torch, time, statistics
from diffspec.api import load_engine
from diffspec.policies import make_policy
eng = load_engine("smollm2-135m-instruct", drafter="/work/runs19/block16/drafter", policy=make_policy("fixed", gamma=8), quiet=True, backend="transformers")
d = eng.drafter
eng.generate("Hello there, how are you?", max_new_tokens=8)
routed = d._draft_head; plain = (routed[0], routed[1], None)
B, mask = d.config.block_size, d.config.mask_token_id
d.begin(None); d._commit([mask]*128)
res = {}
for n in (15, 8, 4, 2, 1):
    rows = list(range(B - n, B))
    t = {"F.linear": [], "routed": []}
    for turn in range(7):
        for name, head in (("F.linear", plain), ("routed", routed)):
            d._draft_head = head
            for _ in range(2): d._block_logits([mask]*B, rows)
            ts = []
            for _ in range(7):
                s = time.perf_counter(); d._block_logits([mask]*B, rows); ts.append(time.perf_counter() - s)
            t[name].append(statistics.median(ts) * 1e3)
    a, b = min(t["F.linear"]), min(t["routed"])
    print(f"rows read {n:2d}: F.linear head {a:6.2f} ms a step, routed head {b:6.2f} ms  ({a/b:.2f}x)", flush=True)
