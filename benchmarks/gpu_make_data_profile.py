"""Issue 16, GPU: where a step of make-data's batched generation goes (training/store.generate_batch).

On the H200 (2026-11-26) make-data generated 7,514 tokens/s at batch 512, ~68 ms a decode step, against the
issue's goal of 50k. This script needs no weights (a random model of SmolLM2-135M's shape, float32 as the
target runs) and says where a step goes: the wall time of a decode step per batch size and per way of running
it (generate_batch's `decode_step`: `model`, transformers' forward with SDPA's own kernel choice; `model-math`,
the same under SDPA's math backend alone (compiled.math_attention: the memory-efficient kernel took 6.8 of a
CUDA-graph pass's 8 ms there, one query a row); `direct` and `graph`, training/batch_step.py's step, eager and
as CUDA graphs), each kind's greedy answers against `model`'s, then a profiler table of the steps at the
widest batch (the model's forward), by GPU time and by CPU time (a launch-bound step shows little GPU time
under a long CPU one).

    python benchmarks/gpu_make_data_profile.py --out DIR                 # on the GPU
    python benchmarks/gpu_make_data_profile.py --device cpu --layers 2 --batches 4 --kinds model direct --out /tmp/p
"""
import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from diffspec.compiled import math_attention
from diffspec.training import batch_step
from diffspec.training.store import BatchSession, generate_batch
from gpu_profiling import smollm2_shaped, write_profile_table


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--kinds", nargs="+", default=["model", "model-math", "direct", "graph"])
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = smollm2_shaped(dev, a.layers)
    report = {"device": str(dev), "layers": a.layers, "prompt_tokens": a.prompt_tokens, "steps": {}}

    def run(batch, new, kind="model", session=None):
        g = torch.Generator().manual_seed(batch)  # the same prompts for every kind at a batch size
        prompts = torch.randint(3, 49152, (batch, a.prompt_tokens), generator=g).tolist()
        sync()
        t0 = time.perf_counter()
        with (math_attention() if kind == "model-math" else contextlib.nullcontext()):
            # no stop ids: every row runs `new` steps
            answers = generate_batch(model, prompts, new, stop_ids=[], pad_id=0,
                                     decode_step="model" if kind == "model-math" else kind, session=session)
        sync()
        return time.perf_counter() - t0, answers

    for b in a.batches:
        reference = None
        for kind in a.kinds:
            try:
                # one session per kind and batch, as make-data keeps one: the warm-up captures the graphs the timed
                # runs replay (the count below is the timed run's own: 0 where every shape was seen)
                session = BatchSession(model, b, a.prompt_tokens + 2 + a.new_tokens,
                                       "model" if kind == "model-math" else kind)
                run(b, 2, kind, session)
                (short, _) = run(b, 1, kind, session)
                before = batch_step.captures
                (long, answers) = run(b, 1 + a.new_tokens, kind, session)
                captured = batch_step.captures - before
            except Exception as error:  # one kind failing must not cost the others' figures
                report["steps"][f"{b} {kind}"] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(b, kind, report["steps"][f"{b} {kind}"], flush=True)
                continue
            step = (long - short) / a.new_tokens
            reference = answers if reference is None else reference
            same = sum(x == y for x, y in zip(answers, reference))
            report["steps"][f"{b} {kind}"] = {"decode_step_ms": round(1000 * step, 2), "tokens_per_s": round(b / step, 1),
                                              "prefill_s": round(short, 3), "answers_equal_first_kind": f"{same}/{b}",
                                              "graphs_captured": captured, "graph_failures": list(batch_step._graph_failed)}
            print(b, kind, report["steps"][f"{b} {kind}"], flush=True)
            (out / "make_data_steps.json").write_text(json.dumps(report, indent=1))  # kept if a time limit cuts the rest
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run(a.batches[-1], 1 + 8, "model")
    for by in (["self_cuda_time_total"] if dev.type == "cuda" else []) + ["self_cpu_time_total"]:
        write_profile_table(prof, by, out / f"profile_{by}.txt", by, lines=20)
    (out / "make_data_steps.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
