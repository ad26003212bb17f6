import sys, time, shutil, hashlib
from pathlib import Path
from diffspec import models
out = Path(sys.argv[1]); shutil.rmtree(out, ignore_errors=True)
g = Path(sys.argv[2]) if len(sys.argv) > 2 else Path('/root/.cache/diffspec/gguf/gemma-3-270m-q4_k_m.gguf')
t = time.perf_counter(); models._convert(g, out, True); dt = time.perf_counter() - t
h = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in sorted(out.iterdir())}
print(models.__file__, f"{dt:.1f} s", h)
