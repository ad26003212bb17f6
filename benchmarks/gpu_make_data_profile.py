"""Issue 16, GPU: where a step of make-data's batched generation goes (training/store.generate_batch).

On the H200 (2026-11-26) make-data generated 7,514 tokens/s at batch 512, ~68 ms a decode step, against the
issue's goal of 50k. This script needs no weights (a random model of SmolLM2-135M's shape, float32 as the
target runs) and says where a step goes: the wall time of a decode step per batch size, with SDPA's own
kernel choice and with its math backend alone (compiled.math_attention: the memory-efficient kernel took
6.8 of a CUDA-graph pass's 8 ms there, one query a row), then a profiler table of the steps at the widest
batch (SDPA's own choice), by GPU time and by CPU time (a launch-bound step shows little GPU time under a
long CPU one).

    python benchmarks/gpu_make_data_profile.py --out DIR                 # on the GPU
    python benchmarks/gpu_make_data_profile.py --device cpu --layers 2 --batches 4 --out /tmp/p   # a check
"""
import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from diffspec.compiled import math_attention
from diffspec.training.store import generate_batch
from gpu_profiling import smollm2_shaped, write_profile_table


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=24)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = smollm2_shaped(dev, a.layers)
    gen = torch.Generator().manual_seed(0)
    report = {"device": str(dev), "layers": a.layers, "prompt_tokens": a.prompt_tokens, "steps": {}}

    def run(batch, new):
        prompts = torch.randint(3, 49152, (batch, a.prompt_tokens), generator=gen).tolist()
        sync()
        t0 = time.perf_counter()
        generate_batch(model, prompts, new, stop_ids=[], pad_id=0)  # no stop ids: every row runs `new` steps
        sync()
        return time.perf_counter() - t0

    for b in a.batches:
        for attention in ("default", "math"):  # SDPA's own choice, then its math backend alone
            with (math_attention() if attention == "math" else contextlib.nullcontext()):
                run(b, 2)  # warm-up
                short, long = run(b, 1), run(b, 1 + a.new_tokens)  # prefill + first token; then the steps
            step = (long - short) / a.new_tokens
            report["steps"][f"{b} {attention}"] = {"decode_step_ms": round(1000 * step, 2),
                                                   "tokens_per_s": round(b / step, 1), "prefill_s": round(short, 3)}
            print(b, attention, report["steps"][f"{b} {attention}"], flush=True)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run(a.batches[-1], 1 + 8)
    for by in (["self_cuda_time_total"] if dev.type == "cuda" else []) + ["self_cpu_time_total"]:
        write_profile_table(prof, by, out / f"profile_{by}.txt", by, lines=20)
    (out / "make_data_steps.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
