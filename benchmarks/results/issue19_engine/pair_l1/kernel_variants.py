import ctypes, time, statistics, torch, sys
from diffspec.api import load_engine
eng = load_engine(drafter=None, policy="fixed", backend="transformers", kernels="auto", quiet=True)
ws = {}
for name, mod in eng.target.model.named_modules():
    pw = mod.__dict__.get("packed_weight")
    if pw is not None: ws.setdefault(tuple(pw.shape), pw)
libs = {n: ctypes.CDLL(f"/tmp/kx/{n}.so") for n in ("old", "new")}
for l in libs.values():
    for f in (l.diffspec_q4_linear, l.diffspec_q8_linear):
        f.restype = None
    l.diffspec_q4_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    l.diffspec_q8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
def call(l, x, w):
    R, K = x.shape; N = w.codes.shape[0]; y = torch.empty(R, N)
    if w.codes.dtype == torch.uint8:
        l.diffspec_q4_linear(x.data_ptr(), R, K, w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), N, y.data_ptr(), 2)
    else:
        l.diffspec_q8_linear(x.data_ptr(), R, K, w.codes.data_ptr(), w.scales.data_ptr(), N, y.data_ptr(), 2)
    return y
for shape, w in ws.items():
    for R in range(1, 9):
        x = torch.randn(R, shape[1])
        ys = {n: call(l, x, w) for n, l in libs.items()}
        assert all(torch.equal(ys["old"], y) for y in ys.values())
        res = {n: [] for n in libs}
        for turn in range(5):
            for n, l in libs.items():
                ts = []
                for _ in range(15):
                    a = time.perf_counter(); call(l, x, w); ts.append(time.perf_counter() - a)
                res[n].append(statistics.median(ts))
        print(shape, R, " ".join(f"{n}:{1e6*min(v):.0f}" for n, v in res.items()), flush=True)
