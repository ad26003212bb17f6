import sys, time, cProfile, pstats
sys.path.insert(0, "/work/main/tests")
import torch
torch.set_num_threads(1)
import test_engine_sampling as T
from diffspec import SpeculativeEngine, FixedPolicy, SamplingParams, AutoregressiveDrafter, PromptLookupDrafter
models = (T.make_model(T.V, seed=5, std=0.6), T.make_model(T.V, seed=6, layers=1, std=0.6))
kind = sys.argv[1]
target = T.cpu_target(models[0])
if kind == "ar":
    d = AutoregressiveDrafter(models[1])
elif kind == "plain":
    d = None
elif kind == "pl":
    d = PromptLookupDrafter()
else:
    d = T.diffusion_drafter(kind, target)
from diffspec import FailFastPolicy
eng = SpeculativeEngine(target, d, FixedPolicy(3) if d is not None else FailFastPolicy())
p = T.SETTINGS["temperature"]
T.sample_counts(eng, p, 50)
t = time.perf_counter(); T.sample_counts(eng, p, 300); dt = time.perf_counter() - t
print(kind, f"{dt/300*1e3:.2f} ms/request")
if len(sys.argv) > 2:
    cProfile.run("T.sample_counts(eng, p, 300)", "/tmp/prof/out")
    s = pstats.Stats("/tmp/prof/out"); s.sort_stats("tottime").print_stats(25)
