"""The fused layers' old C source (a copy in OLD_DIR: fused_layers.c with the kernels it includes) against the
working tree's, on the default target: bitwise equal logits and hidden states, then pass times interleaved.
    python ab_fused.py OLD_DIR KERNELS WIDTH...   (KERNELS: auto or q8)"""
import statistics, sys, time
from pathlib import Path
import torch
from diffspec import fused_layers as fl
from diffspec.target import Target

old_dir, kern, widths = Path(sys.argv[1]), sys.argv[2], [int(w) for w in sys.argv[3:]]
new_lib = fl.build_library(fl.NATIVE)
old_lib = fl.compile_and_load(old_dir / "fused_layers.c", "fused-layers-old", fl.NATIVE,
                              includes=(old_dir / "packed_linear.c", old_dir / "q8_linear.c"))
for name in ("diffspec_fused_work_floats", "diffspec_fused_layers"):  # the same signatures
    f_old, f_new = getattr(old_lib, name), getattr(new_lib, name)
    f_old.argtypes, f_old.restype = f_new.argtypes, f_new.restype
t = Target.load(kernels=kern, quiet=True)
fused = t.direct_pass.fused
assert fused is not None, "no fused layers"
ids = torch.randint(100, 40000, (2000,), generator=torch.Generator().manual_seed(0))
torch.set_num_threads(2)


def run(lib, ctx, width, reps=0):
    fused.lib = lib
    t.reset(); t.reserve(ctx + width + 1)
    t.forward(ids[:ctx], logits=False)
    screen, t.greedy_head = t.greedy_head, None
    out = t.forward(ids[ctx:ctx + width], hidden_layers=None) if False else t.forward(ids[ctx:ctx + width])
    logits = out.logits.clone()
    t.greedy_head = screen
    t.truncate(ctx)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); t.forward(ids[ctx:ctx + width]).greedy_tokens(); times.append(time.perf_counter() - t0)
        t.truncate(ctx)
    return logits, times


for ctx in (64, 256, 1024):
    for width in widths:
        a, _ = run(old_lib, ctx, width)
        b, _ = run(new_lib, ctx, width)
        assert torch.equal(a, b), (ctx, width, (a - b).abs().max().item())
print("bitwise equal logits at every context and width", flush=True)
for ctx in (256, 1024):
    for width in widths:
        best = {"old": [], "new": []}
        for turn in range(4):
            for tag, lib in ((("old", old_lib), ("new", new_lib)) if turn % 2 == 0 else (("new", new_lib), ("old", old_lib))):
                best[tag].append(statistics.median(run(lib, ctx, width, reps=5)[1]))
        o, n = min(best["old"]) * 1e3, min(best["new"]) * 1e3
        print(f"{kern} context {ctx} width {width:2d}: old {o:7.2f} ms, new {n:7.2f} ms, {o / n:4.2f}x", flush=True)
