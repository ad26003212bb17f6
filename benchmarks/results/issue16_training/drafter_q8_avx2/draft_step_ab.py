"""A conditioned drafter's steady-state draft step (context 64 + one position of features, then block_logits: what the
auto dtype choice times) in float32, bfloat16 and q8, interleaved, 5 turns; min over turns of each turn's median of 5.
    python draft_step_ab.py [DRAFTER ...]"""
import sys, json, platform, subprocess
import torch
from diffspec.target import Target
from diffspec.drafter_names import make_drafter
t = Target.load(None, quiet=True)
flags = sorted(set(subprocess.run("grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo", shell=True,
                                  capture_output=True, text=True).stdout.split()))
out = {"cpu_flags": flags, "threads": torch.get_num_threads(), "torch": torch.__version__, "drafters": {}}
for path in sys.argv[1:] or ["conditioned"]:
    ds = {}
    for dd in ("float32", "bfloat16", "q8"):
        d = make_drafter(path, t, compute_dtype=dd)
        d.attach(t)
        ds[dd] = d
    res = {dd: [] for dd in ds}
    for turn in range(5):
        for dd, d in ds.items():
            for ctx in (64, 512):
                res[dd].append((ctx, d._time_step(context_len=ctx)))
    row = {dd: {str(c): round(min(ms for cc, ms in v if cc == c), 2) for c in (64, 512)} for dd, v in res.items()}
    out["drafters"][path] = {"describe": {dd: d.describe() for dd, d in ds.items()}, "ms_a_step": row}
    print(path, row, file=sys.stderr)
print(json.dumps(out, indent=1))
