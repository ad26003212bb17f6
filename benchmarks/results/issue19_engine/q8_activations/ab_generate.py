"""End to end, interleaved: plain decoding and the default drafter (`auto`: prompt lookup + the shipped conditioned
drafter under the auto policy) on two targets in one process, `--kernels auto` (float32 products, the default) and
`--kernels q8` (8-bit activations). Per prompt, the four methods run in turn (after one warm-up request each).

    python benchmarks/results/issue19_engine/q8_activations/ab_generate.py OUT_DIR [--num-prompts 10] [--max-new-tokens 256]

Writes OUT_DIR/results.jsonl (a row per prompt and method: tokens, seconds, target passes, rounds, equal to its
target's plain) and OUT_DIR/summary.json (throughput ratios, total tokens / total time, against float32 plain and
against the same target's plain; per set and over all)."""
import argparse, json, time
from pathlib import Path

from diffspec.api import load_engine
from diffspec.datasets import load_prompts
from diffspec.machine_keys import machine_key

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--num-prompts", type=int, default=10)
ap.add_argument("--max-new-tokens", type=int, default=256)
args = ap.parse_args()
out = Path(args.out); out.mkdir(parents=True, exist_ok=True)

engines = {}
for kernels in ("auto", "q8"):
    engines[f"{kernels}/plain"] = load_engine(drafter=None, backend="transformers", kernels=kernels, quiet=True)
    engines[f"{kernels}/auto"] = load_engine(drafter="auto", policy="auto", backend="transformers", kernels=kernels,
                                             quiet=True)
for e in engines.values():  # warm-up
    e.generate("Say hello.", max_new_tokens=16)

rows = []
with open(out / "results.jsonl", "w") as f:
    for dataset in ("humaneval", "mtbench", "champ"):
        for pid, prompt in load_prompts(dataset)[: args.num_prompts]:
            plain = {}
            for name, e in engines.items():
                t0 = time.perf_counter()
                r = e.generate(prompt, max_new_tokens=args.max_new_tokens)
                s = time.perf_counter() - t0
                kernels, method = name.split("/")
                if method == "plain":
                    plain[kernels] = r.token_ids
                row = {"dataset": dataset, "prompt": pid, "method": name, "tokens": len(r.token_ids), "seconds": s,
                       "target_passes": sum(x.target_forward_passes for x in r.rounds) + r.prefill_forward_passes,
                       "rounds": r.num_rounds, "speculation_off_rounds": r.speculation_off_rounds,
                       "mean_accepted_length": r.mean_accepted_length,
                       "equals_its_plain": r.token_ids == plain.get(kernels)}
                if method == "plain" and kernels == "q8":
                    row["equals_float32_plain"] = r.token_ids == plain["auto"]
                    n = min(len(r.token_ids), len(plain["auto"]))
                    row["first_difference"] = next((i for i in range(n) if r.token_ids[i] != plain["auto"][i]), None)
                rows.append(row)
                f.write(json.dumps(row) + "\n"); f.flush()
            print(dataset, pid, {r["method"]: round(r["tokens"] / r["seconds"], 1) for r in rows[-4:]}, flush=True)


def tput(sel):
    return sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel)


summary = {"machine": machine_key("cpu"), "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
           "runtime": {k: e.target.runtime() for k, e in engines.items() if k.endswith("plain")}, "sets": {}}
for dataset in ("humaneval", "mtbench", "champ", "all"):
    sel = [r for r in rows if dataset == "all" or r["dataset"] == dataset]
    by = {m: [r for r in sel if r["method"] == m] for m in engines}
    base = tput(by["auto/plain"])
    summary["sets"][dataset] = {
        m: {"tok_s": round(tput(v), 2), "vs_float32_plain": round(tput(v) / base, 3),
            "vs_its_plain": round(tput(v) / tput(by[m.split("/")[0] + "/plain"]), 3),
            "target_passes": sum(r["target_passes"] for r in v), "tokens": sum(r["tokens"] for r in v),
            "all_equal_its_plain": all(r["equals_its_plain"] for r in v)} for m, v in by.items()}
    q8p = by["q8/plain"]
    summary["sets"][dataset]["q8 plain == float32 plain (prompts)"] = \
        f"{sum(r['equals_float32_plain'] for r in q8p)}/{len(q8p)}"
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary["sets"], indent=1))
