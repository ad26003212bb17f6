"""MAC rate of the q8 kernel on SmolLM2's output head (Q8_0 codes, 49152 x 576) against its Q4_1 layers, per row count."""
import time, torch
from diffspec import Target
from diffspec import q8_linear as Q
from diffspec.packed_linear import current_pack
torch.set_num_threads(2)
t = Target.load(None, kernels="q8", quiet=True)
m = t.model
shapes = {"head": m.lm_head, "gate": m.model.layers[0].mlp.gate_proj, "down": m.model.layers[0].mlp.down_proj,
          "q": m.model.layers[0].self_attn.q_proj}
for name, lin in shapes.items():
    p = current_pack(lin)
    print(name, tuple(lin.weight.shape), getattr(p, "kind", None) or type(p).__name__, getattr(p, "ggml_type", ""))
for rows in (1, 16, 32, 64):
    for name, lin in shapes.items():
        p = current_pack(lin); w = Q.Q8Weight.of(p)
        x = torch.randn(rows, lin.weight.shape[1])
        reps = max(3, int(2e9 / (rows * lin.weight.numel())))
        for _ in range(2): Q.q8_linear(x, w)
        t0 = time.perf_counter()
        for _ in range(reps): Q.q8_linear(x, w)
        dt = (time.perf_counter() - t0) / reps
        print(f"rows {rows:3d} {name:5s} {dt*1e3:7.2f} ms  {rows*lin.weight.numel()/dt/1e9:6.1f} GMAC/s")
