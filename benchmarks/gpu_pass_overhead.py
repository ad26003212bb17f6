"""Issue 19, GPU: where a one-row pass's time goes under `--compile on` (fixed-capacity cache, CUDA graphs).

On the H200 (2026-11-26) a one-row pass of SmolLM2-135M cost 8.8 ms as CUDA graphs against 17.3 ms eager,
where one graph launch of a 135M model should take ~1-2 ms: this script found 6.8 ms of it in SDPA's
memory-efficient kernel, and after compiled.math_attention the pass took 2.5 ms
(benchmarks/results/issue19_engine/gpu_h200/pass_overhead_*.json). This script needs no weights (a random model of
SmolLM2-135M's shape) and says where the rest goes: dynamo's counters (graph breaks, graphs, CUDA graph
skips), the pass timed through Target.forward against the compiled function alone and with dynamo's guards
skipped, and a profiler table of the CPU side.

    python benchmarks/gpu_pass_overhead.py --out DIR
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo

from diffspec import compiled as C
from diffspec.target import Target
from gpu_profiling import smollm2_shaped, write_profile_table


def timed(fn, reps, sync):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return round(1000 * times[len(times) // 2], 3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--layers", type=int, default=30)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    C.WIDTH_BUCKETS = (1,)
    report = {}
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(0))
    torch._dynamo.utils.counters.clear()
    targets = {"eager": Target(smollm2_shaped(dev, a.layers)),
               "fixed": Target(smollm2_shaped(dev, a.layers), compile="on")}
    report["runtime"] = {k: str(t.runtime()) for k, t in targets.items()}
    for name, t in targets.items():
        t.forward(ids[:100], logits=False)

        def one(t=t):
            t.forward(ids[100:101])
            t.truncate(100)
        for _ in range(5):
            one()
        report[f"{name}_forward_ms"] = timed(one, a.reps, sync)
    report["counters"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                          if k in ("stats", "graph_break", "inductor")}
    comp = targets["fixed"]

    @torch.inference_mode()
    def raw():  # the compiled function alone, as _compiled_pass calls it (under run's attention backend)
        torch.compiler.cudagraph_mark_step_begin()
        with C.math_attention():
            comp.compiled.fn(input_ids=ids[100:101].to(dev).view(1, 1), past_key_values=comp._cache,
                             use_cache=True, output_hidden_states=True, logits_to_keep=0)
        comp.truncate(100)
    report["fixed_compiled_fn_ms"] = timed(raw, a.reps, sync)

    def raw_noguards():
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            raw()
    try:
        raw_noguards()
        report["fixed_compiled_fn_guards_skipped_ms"] = timed(raw_noguards, a.reps, sync)
    except Exception as e:  # noqa: BLE001 - reported
        report["fixed_compiled_fn_guards_skipped_ms"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(report, indent=1), flush=True)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    eager = targets["eager"]
    for name, fn in (("fixed_forward", lambda: (comp.forward(ids[100:101]), comp.truncate(100))),
                     ("eager_forward", lambda: (eager.forward(ids[100:101]), eager.truncate(100)))):
        with profile(activities=acts) as prof:
            for _ in range(10):
                fn()
            sync()
        by = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        write_profile_table(prof, by, out / f"profile_{name}.txt", name)
    (out / "pass_overhead.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
