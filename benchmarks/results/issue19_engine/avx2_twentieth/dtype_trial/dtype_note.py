import sys, time
from diffspec.api import load_engine
t = time.perf_counter()
e = load_engine("smollm2-135m-instruct", drafter="/work/runs19/block16/drafter", policy="fixed", gamma=8, backend="transformers")
d = e.drafter
print(f"{sys.argv[1]}: {d.dtype_note}   (load {time.perf_counter()-t:.0f} s)", flush=True)
