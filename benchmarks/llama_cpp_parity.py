"""Does a llama.cpp verify pass give every row what a one-token step gives? (issue 18, exactness)

For each bench prompt: plain greedy decoding on the llama.cpp backend (one token a pass, as the
engine's `--drafter none`), then the same continuation teacher-forced in passes of width w (a
verify pass of k = w - 1 drafted tokens, the drafts all correct). A row whose argmax differs from
the token plain decoding chose is a place where speculative decoding could leave plain's path.
Reported per width: prompts with every row in agreement (the parity rate), rows that disagree,
and the largest logit difference between the two ways of computing the same row.

    python benchmarks/llama_cpp_parity.py --dataset all --num-prompts 20 --max-new-tokens 256 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from diffspec.backends.llama_cpp import LlamaCppTarget
from diffspec.bench.prompts import load_bench_prompts


def plain(target, prompt_ids, max_new_tokens):
    """Greedy one-token decoding -> (new tokens, the logits row that chose each)."""
    target.reset()
    target.forward(torch.tensor(prompt_ids[:-1]), logits=False)
    last, new, rows = prompt_ids[-1], [], []
    for _ in range(max_new_tokens):
        row = target.forward(torch.tensor([last])).logits[0]
        last = int(row.argmax())
        new.append(last)
        rows.append(row)
        if last in target.stop_token_ids:
            break
    return new, torch.stack(rows)


def teacher_forced(target, prompt_ids, new, width):
    """The logits of the same rows computed in passes of `width` tokens: [last, d_1..d_{w-1}]."""
    target.reset()
    target.forward(torch.tensor(prompt_ids[:-1]), logits=False)
    seq = [prompt_ids[-1]] + new[:-1]  # row i predicts new[i]
    rows = []
    for s in range(0, len(seq), width):
        rows.append(target.forward(torch.tensor(seq[s:s + width])).logits)
    return torch.cat(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset", default="all")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 5, 9, 17])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    target = LlamaCppTarget.load(args.model, quiet=True)
    prompts = load_bench_prompts(args.dataset, args.num_prompts)
    per_width = {w: {"prompts_all_agree": 0, "rows": 0, "rows_disagree": 0, "max_abs_logit_diff": 0.0,
                     "bitwise_equal_rows": 0} for w in args.widths}
    records = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = target.encode_prompt(p.text)
        new, ref = plain(target, ids, args.max_new_tokens)
        rec = {"dataset": p.dataset, "prompt_id": p.prompt_id, "new_tokens": len(new)}
        for w in args.widths:
            got = teacher_forced(target, ids, new, w)
            disagree = int((got.argmax(-1) != torch.tensor(new)).sum())
            diff = float((got - ref).abs().max())
            stats = per_width[w]
            stats["rows"] += len(new)
            stats["rows_disagree"] += disagree
            stats["prompts_all_agree"] += disagree == 0
            stats["max_abs_logit_diff"] = max(stats["max_abs_logit_diff"], diff)
            stats["bitwise_equal_rows"] += int((got == ref).all(-1).sum())
            rec[f"w{w}"] = {"rows_disagree": disagree, "max_abs_logit_diff": diff}
        records.append(rec)
        print(f"[{i + 1}/{len(prompts)}] {p.dataset}/{p.prompt_id}: {len(new)} tokens, "
              + ", ".join(f"w{w} diff {rec[f'w{w}']['max_abs_logit_diff']:.2e} disagree {rec[f'w{w}']['rows_disagree']}"
                          for w in args.widths), file=sys.stderr, flush=True)
    summary = {"model": target.name, "gguf": str(target.gguf), "threads": target.threads, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "seconds": round(time.perf_counter() - t0, 1),
               "widths": {str(w): {**s, "parity_rate": s["prompts_all_agree"] / max(1, len(prompts))}
                          for w, s in per_width.items()},
               "command": "python benchmarks/llama_cpp_parity.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps({"summary": summary, "prompts": records}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
