"""Plain decoding on the q8 target (--kernels q8), 256 tokens x prompts; prints tok/s and a hash of the outputs."""
import sys, time, json, hashlib
import diffspec
from diffspec.api import load_engine
from diffspec.datasets import load_prompts
n = int(sys.argv[1]); out = sys.argv[2]
prompts = [t for ds in ("humaneval", "mtbench", "champ") for _, t in load_prompts(ds)[:n]]
e = load_engine(drafter="none", backend="transformers", kernels="q8", quiet=True)
e.generate(prompts[0], max_new_tokens=32)
tok, wall, ids, passes = 0, 0.0, [], 0
step = []
for p in prompts:
    e.target.reset()
    t0 = time.perf_counter(); r = e.generate(p, max_new_tokens=256); wall += time.perf_counter() - t0
    tok += len(r.token_ids); ids.append(r.token_ids); passes += r.target_forward_passes
    step += [s.verify_time_s for s in r.rounds]
step.sort()
res = {"src": diffspec.__file__, "tokens": tok, "wall_s": wall, "tok_s": tok / wall, "passes": passes,
       "median_step_ms": 1e3 * step[len(step) // 2], "ids_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}
print(json.dumps(res)); open(out, "a").write(json.dumps(res) + "\n")
