"""What one verify pass of k tokens costs the target, for k = 1, 2, 4, ... (run on a quiet machine).

    python benchmarks/verify_cost.py --out benchmarks/results/verify_cost
    python benchmarks/verify_cost.py --threads 2 --context 300 --repeats 21 --max-k 64 --out DIR

The default target (`diffspec.Target.load(None)`, fp32 unless --dtype) gets a KV cache of
`--context` tokens of real text (HumanEval prompts, no chat template, concatenated and cut),
filled in one pass. Then for each k a forward pass appends the next k tokens of that text
(what the engine's verify pass does: one target pass over [last token, d1..dk-1], logits for
every position, no hidden states; so k = the tokens in the pass = drafted tokens + 1, and k=1 is a
plain decoding step) and the cache is rolled back with `target.truncate` to the
context length, so every pass sees the same cache. `--warmup` passes per k come first
(not timed); then `--repeats` rounds, each timing every k once, the order of the k rotated from
round to round so drift hits all k alike. Reported per k: median, min and max ms, the median
relative to k=1, and the median per token.

Writes DIR/verify_cost.json (settings, machine, every timing) and DIR/verify_cost.md (the table),
and prints the table. The machine record (CPU model and the avx2 / avx512f / avx512_bf16 /
amx_bf16 flags from /proc/cpuinfo, torch version and threads, commit) is bench's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64)


def context_tokens(target, n: int) -> list:
    """n + max-k tokens of real text: HumanEval prompts (raw, no chat template) one after another."""
    from diffspec.bench.prompts import load_bench_prompts

    ids: list = []
    for prompt in load_bench_prompts("humaneval", None):
        ids += target.encode_prompt(prompt.text, chat=False)
        if len(ids) >= n:
            break
    return ids


def _sync(target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def time_pass(target, tokens: torch.Tensor, context: int) -> float:
    """Seconds for one forward pass of `tokens` on a cache of `context` positions; rolls it back."""
    _sync(target)
    t0 = time.perf_counter()
    target.forward(tokens)
    _sync(target)
    elapsed = time.perf_counter() - t0
    target.truncate(context)
    return elapsed


def measure(target, ks, context: int, repeats: int, warmup: int) -> dict:
    """{k: [seconds per repeat]} with the cache holding `context` tokens before every pass."""
    need = context + max(ks)
    if need > target.max_context:
        raise SystemExit(f"verify_cost: context {context} + k {max(ks)} exceeds the target's {target.max_context}")
    ids = context_tokens(target, need)
    if len(ids) < need:
        raise SystemExit(f"verify_cost: the prompts give only {len(ids)} tokens, {need} needed")
    target.reset()
    target.forward(torch.tensor(ids[:context]))  # fill the cache in one pass
    probes = {k: torch.tensor(ids[context: context + k]) for k in ks}
    for k in ks:
        for _ in range(warmup):
            time_pass(target, probes[k], context)
    times: dict = {k: [] for k in ks}
    for r in range(repeats):
        order = list(ks[r % len(ks):]) + list(ks[:r % len(ks)])
        for k in order:
            times[k].append(time_pass(target, probes[k], context))
    return times


def summarize(times: dict) -> list:
    base = statistics.median(times[min(times)])
    out = []
    for k, ts in times.items():
        med = statistics.median(ts)
        out.append({"k": k, "median_ms": round(1000 * med, 2), "min_ms": round(1000 * min(ts), 2),
                    "max_ms": round(1000 * max(ts), 2), "vs_k1": round(med / base, 3) if min(times) == 1 else None,
                    "ms_per_token": round(1000 * med / k, 2), "repeats": len(ts)})
    return out


def markdown(record: dict) -> str:
    m, s = record["machine"], record["settings"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    lines = ["# Target verify cost by draft length", "", "Command:", "", f"    {s['command']}", "",
             f"Machine: {m['cpu']} ({m['cpus']} CPUs; {flags}); torch threads {m['threads']}; torch {m['torch']}, "
             f"transformers {m['transformers']}, Python {m['python']}; commit {m['commit']}"
             + (f"; GPU {m['gpu']}" if m.get("gpu") else "") + ".", "",
             f"Target {s['target']} ({s['dtype']}, {s['device']}); KV cache of {s['context']} tokens; one forward pass "
             f"of k tokens, then the cache rolled back; {s['warmup']} warm-up pass(es) per k, then {s['repeats']} "
             "rounds timing every k once (order rotated per round).", "",
             "| k | median ms | min ms | max ms | median vs k=1 | ms per token |", "|---|---|---|---|---|---|"]
    for e in record["results"]:
        vs = "-" if e["vs_k1"] is None else f"{e['vs_k1']:.2f}x"
        lines.append(f"| {e['k']} | {e['median_ms']:.1f} | {e['min_ms']:.1f} | {e['max_ms']:.1f} | {vs} | "
                     f"{e['ms_per_token']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Time the target's verify pass of k tokens on a filled KV cache.")
    parser.add_argument("--model", default=None, help="target (default: diffspec's default target)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--context", type=int, default=300, help="tokens in the KV cache before each pass")
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="draft lengths to time")
    parser.add_argument("--max-k", type=int, default=None, help="drop the ks above this")
    parser.add_argument("--repeats", type=int, default=21, help="timed passes per k (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes per k first")
    parser.add_argument("--out", default="benchmarks/results/verify_cost", help="folder for the JSON and markdown")
    args = parser.parse_args(argv)
    ks = tuple(sorted({k for k in args.ks if k >= 1 and (args.max_k is None or k <= args.max_k)}))
    if not ks or args.repeats < 1 or args.warmup < 0 or args.context < 1:
        parser.error("need at least one k >= 1 (within --max-k), --repeats >= 1, --warmup >= 0, --context >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from diffspec import Target
    from diffspec.bench.run import machine_info

    target = Target.load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    times = measure(target, ks, args.context, args.repeats, args.warmup)
    machine = machine_info()
    if target.device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(target.device)
    given = sys.argv[1:] if argv is None else list(argv)
    record = {"command": " ".join(["python", "benchmarks/verify_cost.py"] + given),
              "settings": {"target": target.name, "dtype": args.dtype, "device": args.device, "context": args.context,
                           "ks": list(ks), "repeats": args.repeats, "warmup": args.warmup,
                           "threads": torch.get_num_threads()},
              "machine": machine, "results": summarize(times),
              "times_s": {str(k): [round(t, 6) for t in ts] for k, ts in times.items()}}
    record["settings"]["command"] = record["command"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(record, indent=1) + "\n")
    md = markdown(record)
    (out / "verify_cost.md").write_text(md)
    print(md, end="")
    print(f"written: {out / 'verify_cost.json'}, {out / 'verify_cost.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
