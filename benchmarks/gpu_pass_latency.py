"""Issue 19, GPU part: what one target pass costs, eager against compiled, and with CUDA graphs.

Measures, for SmolLM2-135M (or --model), the wall time of one pass over k + 1 tokens (k = 0: a plain
decoding step) at a --context-token context, rolled back after each pass, for three targets built
by diffspec itself (`Target`):
  - `eager`: the position-indexed cache, eager PyTorch (`--compile off`);
  - `dynamic`: the same cache, passes compiled with a symbolic length (`--compile on` on a CPU);
  - `fixed`: the fixed-capacity cache, passes compiled with static shapes, which on CUDA run as CUDA
    graphs (`--compile on` on CUDA: inductor's reduce-overhead).
Each compiled target compiles the widths k + 1 at start (its compile seconds per width are recorded),
and every row of a compiled pass is compared with eager's (argmax, largest logit difference).
Prints a line per k and writes --out JSON.

    python benchmarks/gpu_pass_latency.py --device cuda --out OUT.json
    python benchmarks/gpu_pass_latency.py --device cpu --ks 0 3 --variants eager fixed   # a check on a CPU

(An earlier version drove transformers' StaticCache by hand and passed `cache_position`, which
transformers 5.23 no longer reads: its layers count their length themselves, so every timed pass
wrote further on, and the CPU check read "logits off by 5.3" and then an index out of bounds. The
fixed-capacity cache of `Target` rolls the length back; tests/test_fixed_cache.py checks it.)
"""
import argparse
import json
import time

import torch

from diffspec import compiled as C
from diffspec.target import Target

VARIANTS = {"eager": dict(compile="off"), "dynamic": dict(compile="on", fixed_cache=False),
            "fixed": dict(compile="on", fixed_cache=True)}


def timed(fn, device, reps):
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7, 15])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", default="stock", help="diffspec --kernels (on a CPU: auto is the default there)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    C.WIDTH_BUCKETS = tuple(sorted({k + 1 for k in args.ks}))  # compile exactly the widths measured
    targets, started = {}, {}
    for name in args.variants:
        t0 = time.perf_counter()
        targets[name] = Target.load(args.model, device=args.device, quiet=True, kernels=args.kernels, **VARIANTS[name])
        started[name] = {"start_s": round(time.perf_counter() - t0, 1), "compile_s": targets[name].compiled.compile_s,
                         "runs": targets[name].compiled.describe(), "cache": targets[name].runtime()["cache"]}
        print(name, started[name], flush=True)
    first = next(iter(targets.values()))
    device = first.device
    ids = torch.randint(0, first.vocab_size, (args.context + max(args.ks) + 1,),
                        generator=torch.Generator().manual_seed(0)).to(device)
    for target in targets.values():
        target.reserve(args.context + max(args.ks) + 1)
        target.forward(ids[:args.context], logits=False)
    rows = {}
    for k in args.ks:
        tokens = ids[args.context:args.context + k + 1]

        def one_pass(target):
            out = target.forward(tokens)
            target.truncate(args.context)
            return out.logits

        want = one_pass(targets["eager"]) if "eager" in targets else None
        row = {}
        for name, target in targets.items():
            try:
                got = one_pass(target)
                row[f"{name}_ms"] = round(timed(lambda: one_pass(target), device, args.reps), 3)
                if want is not None and name != "eager":
                    row[f"{name}_argmax_equal"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
                    row[f"{name}_max_abs_diff"] = float((got.float() - want.float()).abs().max())
            except Exception as exc:  # a failing pass is a finding, recorded per variant and width
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows[k] = row
        print(f"k {k:2d}: " + ", ".join(f"{a} {b}" for a, b in row.items()), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # where inductor ran a graph without CUDA graphs after all (a CPU tensor or an unmarked mutated input in it)
    skips = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
    record = {"device": name, "torch": torch.__version__, "context": args.context, "kernels": args.kernels,
              "targets": started, "passes": rows, "cudagraph_skips": skips}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
