"""One layer's attention (9 query heads on 3 key/value heads, 64 dims) through scaled_dot_product_attention:
the key/value heads copied (transformers' repeat_kv) against shared in the kernel (enable_gqa=True), with
a causal mask over the cache; bitwise equality and the median time of 50 calls.

    python benchmarks/results/issue19_engine/scripts/gqa_kernel.py
"""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for ctx, n in ((272, 16), (272, 4), (1040, 16), (257, 1)):
    q = torch.randn(1, 9, n, 64, generator=g); k = torch.randn(1, 3, ctx, 64, generator=g); v = torch.randn(1, 3, ctx, 64, generator=g)
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)[None, None]
    def rep(x): return x[:, :, None].expand(1, 3, 3, ctx, 64).reshape(1, 9, ctx, 64)
    a = F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=0.125)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    def tm(f):
        f(); ts=[]
        for _ in range(50):
            t0=time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
        return sorted(ts)[25]*1e6
    ta = tm(lambda: F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=0.125))
    tb = tm(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True))
    print(ctx, n, "bitwise equal", torch.equal(a, b), "maxdiff", (a-b).abs().max().item(), f"repeat_kv {ta:.0f} us  gqa {tb:.0f} us")
