"""Where a wide target pass's time goes inside the fused layers (an instrumented copy of fused_layers.c in
/tmp/fl: timers around the four products, the attention loop and the whole layer loop)."""
import ctypes, statistics, sys, time
from pathlib import Path
import torch
from diffspec import fused_layers as fl
fl.SOURCE = Path(sys.argv.pop(1)) / "fused_layers.c"
fl.build_library.cache_clear()
from diffspec.target import Target
lib = fl.build_library(fl.NATIVE)
lib.diffspec_timers.restype = ctypes.POINTER(ctypes.c_double)
timers = lib.diffspec_timers()
kern = sys.argv[1]
t = Target.load(kernels=kern, quiet=True)
ids = torch.randint(100, 40000, (400,), generator=torch.Generator().manual_seed(0))
ctx = 256
for width in [int(w) for w in sys.argv[2:]]:
    t.reset(); t.reserve(ctx + width + 1); t.forward(ids[:ctx], logits=False)
    for _ in range(2):
        t.forward(ids[ctx:ctx + width]).greedy_tokens(); t.truncate(ctx)
    for i in range(3): timers[i] = 0.0
    reps, tot = 5, 0.0
    for _ in range(reps):
        t0 = time.perf_counter(); t.forward(ids[ctx:ctx + width]).greedy_tokens(); tot += time.perf_counter() - t0
        t.truncate(ctx)
    lin, att, layers = (timers[i] / reps * 1e3 for i in range(3))
    total = tot / reps * 1e3
    print(f"{kern} {width:2d} rows @ {ctx}: pass {total:6.1f} ms = layers {layers:6.1f} (products {lin:6.1f}, "
          f"attention {att:5.1f}, rest {layers - lin - att:5.1f}) + outside the layers {total - layers:5.1f}", flush=True)
