"""What the verify-cost A/B scripts of this folder (ab3, ab4, ab5, ab_gqa) share: a target put on a
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


def median_pass_ms(t, ids, ctx, k, reps=5, each=nullcontext):
    """Median ms of `reps` passes over ids[ctx:ctx + k + 1] after one warm-up pass, each rolled back to
    ctx; `each()` is entered around each (timed) pass. -> (ms, the last pass's logits)."""
    ts, logits = [], None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        with each():
            logits = t.forward(ids[ctx:ctx + k + 1]).logits
        ts.append(time.perf_counter() - t0)
        t.truncate(ctx)
    ts = sorted(ts[1:])
    return ts[len(ts) // 2] * 1e3, logits
