"""A plain step (k = 0, 256-token context, eager, --kernels auto) with the packed kernel, and with its calls replaced
by empty outputs: what of a step is not the kernel. Interleaved, 3 turns, median of 9 passes each.

    python benchmarks/results/issue19_engine/scripts/packed_step_without_kernel.py
"""

import torch

from diffspec.target import Target
from diffspec import packed_linear as P
from passes import greedy_choices, median_pass_ms, on_context
torch.set_num_threads(2)
t = Target.load(None, quiet=True, kernels="auto")
ids = torch.randint(0, t.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
real = P._run_kernel
def noop(x, codes, scales, offsets, lib=None):
    return torch.zeros((*x.shape[:-1], codes.shape[0]))
for _ in range(3):
    for name, f in (("real", real), ("no kernel", noop)):
        P._run_kernel = f
        on_context(t, ids, 256)
        print(name, round(median_pass_ms(t, ids, 256, 0, 9, read=greedy_choices)[0], 2))
