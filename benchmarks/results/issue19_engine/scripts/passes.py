"""What the verify-cost A/B scripts of this folder (ab2, ab3, ab4, ab5, ab_gqa, ab_skip_guards) share: a target put on a
fresh context, and the median time of one pass of k + 1 rows on it."""
import time
from contextlib import nullcontext


def on_context(t, ids, ctx, room=80, cache=None):
    """Empty the target's cache (or give it `cache`), reserve ctx + room positions, prefill ids[:ctx]."""
    t.reset()
    if cache is not None:
        t._cache = cache
    t.reserve(ctx + room)
    t.forward(ids[:ctx], logits=False)


def logits(out):
    return out.logits


def greedy_choices(out):
    return out.greedy_tokens()


def median_pass_ms(t, ids, ctx, k, reps=5, each=nullcontext, read=logits):
    """Median ms of `reps` passes over ids[ctx:ctx + k + 1] after one warm-up pass, each rolled back to
    ctx; `each()` is entered around each (timed) pass, whose output `read` reads inside the timing (the
    logits, or `greedy_choices` as the engine reads a greedy verify pass). -> (ms, the last pass's read)."""
    ts, last = [], None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        with each():
            last = read(t.forward(ids[ctx:ctx + k + 1]))
        ts.append(time.perf_counter() - t0)
        t.truncate(ctx)
    ts = sorted(ts[1:])
    return ts[len(ts) // 2] * 1e3, last


def float32_plan(t):
    """The matmul plan `t`'s model would get with no layer packed (packed_linear.py), measured now: the packs
    are set aside for the measurement and put back. -> (that plan, how many linear layers are packed)."""
    from diffspec import kernels as K

    mods = [m for group in K.linear_groups(t.model).values() for m in group]
    saved = {m: m.packed_weight for m in mods}
    for m in mods:
        m.packed_weight = None
    try:
        return K.measure_plan(t.model), sum(p is not None for p in saved.values())
    finally:
        for m, p in saved.items():
            m.packed_weight = p
