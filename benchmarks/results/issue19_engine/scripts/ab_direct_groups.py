"""The direct pass as committed in an earlier commit (default 598f8a7: o_proj and down_proj through their routed
forwards, each pack checked with current_pack on every call) against the working tree's (every packed layer group
straight to the kernel, its row counts found once from the plan), on the default target in one process,
interleaved: a pass of k + 1 rows at a 256-token context, median of 7 passes per turn, min and median over 7
turns. Needs the git history.

    python benchmarks/results/issue19_engine/scripts/ab_direct_groups.py [COMMIT] > OUT.txt
"""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import diffspec
from diffspec.target import Target
from passes import greedy_choices, median_pass_ms, on_context

torch.set_num_threads(2)
root = Path(diffspec.__file__).parents[2]
commit = sys.argv[1] if len(sys.argv) > 1 else "598f8a7"
old_source = subprocess.run(["git", "-C", str(root), "show", f"{commit}:src/diffspec/llama_pass.py"], check=True,
                            capture_output=True, text=True).stdout
path = Path(tempfile.mkdtemp()) / f"llama_pass_{commit}.py"
path.write_text(old_source)
spec = importlib.util.spec_from_file_location(f"diffspec.llama_pass_{commit}", path)
old_module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = old_module  # dataclasses look their module up there
spec.loader.exec_module(old_module)

t = Target.load(None, quiet=True, kernels="auto")
ways = {commit: old_module.LlamaPass(t.model, t.linear_plan), "now": t.direct_pass}
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
for k in (0, 1, 4, 8, 16):
    row, choices = {}, {}
    for _ in range(7):
        for name, way in ways.items():
            t.direct_pass = way
            on_context(t, ids, 256)
            ms, choices[name] = median_pass_ms(t, ids, 256, k, 7, read=greedy_choices)
            row.setdefault(name, []).append(ms)
    same = torch.equal(*choices.values())
    print(f"k {k}: " + "  ".join(f"{n} {min(v):.2f} (median {statistics.median(v):.2f})" for n, v in row.items())
          + f"  same greedy choices: {same}", flush=True)
