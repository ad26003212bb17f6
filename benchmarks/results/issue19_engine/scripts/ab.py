"""c(k) of the transformers target, stock vs measured kernels, interleaved, same process."""
import sys, time, json, torch
from diffspec.target import Target
from diffspec import kernels as K
torch.set_num_threads(2)
t = Target.load(None, quiet=False, kernels="auto")
print(t.linear_plan.describe())
plan = t.linear_plan
ids = torch.randint(0, t.vocab_size, (1200,), generator=torch.Generator().manual_seed(0))
def measure(ctx, k, reps=5):
    t.reset(); t.forward(ids[:ctx], logits=False)
    ts = []
    for r in range(reps + 1):
        t0 = time.perf_counter(); t.forward(ids[ctx:ctx + k + 1]); ts.append(time.perf_counter() - t0); t.truncate(ctx)
    ts = sorted(ts[1:]); return ts[len(ts) // 2] * 1e3
res = {}
for ctx in (256,):
    for k in (0, 1, 2, 3, 4, 6, 8, 12, 16, 32):
        row = {}
        for mode in ("stock", "auto", "stock", "auto"):
            K.uninstall(t.model)
            if mode == "auto": K.install(t.model, plan)
            row.setdefault(mode, []).append(measure(ctx, k))
        res[k] = {m: min(v) for m, v in row.items()}
        print(f"ctx {ctx} k {k}: stock {res[k]['stock']:.1f} ms  auto {res[k]['auto']:.1f} ms  x{res[k]['stock']/res[k]['auto']:.2f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1) if len(sys.argv) > 1 else None
