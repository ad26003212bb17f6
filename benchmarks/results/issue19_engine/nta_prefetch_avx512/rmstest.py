import time, torch, torch.nn.functional as F, statistics
x = torch.randn(1, 1, 576); w = torch.ones(576)
big = torch.randn(30_000_000)
res = {"after big sum (torch, 2 threads)": [], "after sleep 1ms": [], "hot": [], "after 1-thread numpy sum": []}
import numpy as np
nb = np.random.rand(8_000_000).astype(np.float32)
for _ in range(200):
    big.sum(); t0 = time.perf_counter(); F.rms_norm(x, (576,), w, 1e-5); res["after big sum (torch, 2 threads)"].append(time.perf_counter() - t0)
    time.sleep(0.001); t0 = time.perf_counter(); F.rms_norm(x, (576,), w, 1e-5); res["after sleep 1ms"].append(time.perf_counter() - t0)
    t0 = time.perf_counter(); F.rms_norm(x, (576,), w, 1e-5); res["hot"].append(time.perf_counter() - t0)
    nb.sum(); t0 = time.perf_counter(); F.rms_norm(x, (576,), w, 1e-5); res["after 1-thread numpy sum"].append(time.perf_counter() - t0)
for k, v in res.items(): print(f"{k:35s} median {1e6 * statistics.median(v):.1f} us")
