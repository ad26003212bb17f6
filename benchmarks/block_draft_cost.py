"""Block-diffusion drafting cost per round, the same drafter weights run five ways:

  before       float32, the output head on every block row of every pass, the whole vocabulary: what
               drafting did before issue 19 (the issue's "today")
  all-rows     the same in --drafter-dtype
  read-rows    the head on the rows a step reads only (issue 19: `logits_of_rows`)
  draft-vocab  read rows, through the head's rows for the drafter's reduced draft vocabulary only
  compiled     draft-vocab with the body's steady-state pass compiled (drafters/compile_choice.py, `on`)

Every variant is its own engine and drafter object (load_engine shares an engine between calls with the
same arguments, so the variants are built with policy objects: until this was found, every variant of
this script ran the last-configured drafter, and the draft-vocab column measured read-rows).
A reduced draft vocabulary changes the drafts (the softmax runs over fewer tokens, so confidences are
higher and a step unmasks more positions), so passes per round and accepted tokens per round differ
between variants; both are reported.

    python benchmarks/block_draft_cost.py --drafter runs/block16/drafter --out results.json

Fixed draft lengths (policy `fixed`, gamma 4 / 8 / 15), greedy, the target on the transformers backend;
variants interleaved prompt by prompt after a warm-up, so drift on a shared machine hits them alike.
Reported per variant and gamma: drafting milliseconds per round (the engine's own draft timer), drafter
passes per round, accepted drafts per round, rounds; and whether every variant produced the same text as
plain decoding. Ratios are against `before`.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager, nullcontext

import torch

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain why the sky is blue in three sentences.",
           "List the first ten prime numbers and say how you found them."]


@contextmanager
def all_rows():
    """The head on every row, the wanted rows picked afterwards (the drafting of before issue 19)."""
    from diffspec.drafters import block_diffusion

    real = block_diffusion.logits_of_rows

    def every_row(model, rows, **inputs):
        logits = model(**inputs).logits[0]
        return logits[-rows:] if isinstance(rows, int) else logits[torch.tensor(rows, device=logits.device)]

    block_diffusion.logits_of_rows = every_row
    try:
        yield
    finally:
        block_diffusion.logits_of_rows = real


VARIANTS = ("before", "all-rows", "read-rows", "draft-vocab", "compiled")


def cpu_flags() -> list:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return [f for f in wanted if f" {f} " in text or f" {f}\n" in text]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="a block-diffusion drafter folder with a draft vocabulary")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--gammas", type=int, nargs="+", default=[4, 8, 15])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--drafter-dtype", default="float32", help="every variant but before (auto would measure each)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from diffspec.api import load_engine
    from diffspec.checkpoint import load_drafter
    from diffspec.policies import make_policy

    torch.set_num_threads(2)
    ids = load_drafter(args.drafter).draft_token_ids
    if ids is None:
        print(f"{args.drafter} drafts from the whole vocabulary: nothing to compare", file=sys.stderr)
        return 2
    plain = load_engine(args.model, drafter="none", quiet=True, backend="transformers")
    reference = [plain.generate(p, max_new_tokens=args.max_new_tokens).token_ids for p in PROMPTS]
    result = {"drafter": args.drafter, "variants": args.variants, "cpu_flags": cpu_flags(), "draft_vocab": int(ids.numel()), "drafter_dtype": args.drafter_dtype,
              "torch_threads": torch.get_num_threads(),
              "prompts": len(PROMPTS), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "gammas": {}}
    for gamma in args.gammas:
        engines = {}
        for variant in args.variants:  # a policy object: load_engine then builds a new engine and drafter
            eng = load_engine(args.model, drafter=args.drafter, policy=make_policy("fixed", gamma=gamma), quiet=True,
                              backend="transformers",
                              drafter_dtype="float32" if variant == "before" else args.drafter_dtype)
            if variant in ("before", "all-rows", "read-rows"):
                eng.drafter.draft_token_ids = None  # the same weights, the whole head
                eng.drafter._draft_head = None
            if variant == "compiled":
                eng.drafter.compile_passes("on")
            engines[variant] = eng
        assert len({id(e.drafter) for e in engines.values()}) == len(engines), "variants share a drafter"
        described = {v: e.drafter.describe() for v, e in engines.items()}
        result.setdefault("target_runtime", next(iter(engines.values())).target.runtime())
        sums = {v: {"draft_s": 0.0, "rounds": 0, "passes": 0, "accepted": 0, "identical": True} for v in engines}
        for variant, eng in engines.items():  # warm-up
            with (all_rows() if variant in ("before", "all-rows") else nullcontext()):
                eng.generate(PROMPTS[0], max_new_tokens=16)
        for _ in range(args.repeats):
            for i, prompt in enumerate(PROMPTS):
                for variant, eng in engines.items():
                    with (all_rows() if variant in ("before", "all-rows") else nullcontext()):
                        res = eng.generate(prompt, max_new_tokens=args.max_new_tokens)
                    s = sums[variant]
                    s["identical"] &= res.token_ids == reference[i]
                    for r in res.rounds:
                        if r.drafted:
                            s["draft_s"] += r.draft_time_s
                            s["rounds"] += 1
                            s["passes"] += r.drafter_forward_passes
                            s["accepted"] += r.accepted
        row = {v: {"draft_ms_per_round": round(s["draft_s"] / max(1, s["rounds"]) * 1e3, 2),
                   "drafter_passes_per_round": round(s["passes"] / max(1, s["rounds"]), 2),
                   "accepted_per_round": round(s["accepted"] / max(1, s["rounds"]), 3),
                   "rounds": s["rounds"], "identical_to_plain": s["identical"], "drafter": described[v]}
               for v, s in sums.items()}
        base = row.get("before", {}).get("draft_ms_per_round")
        for v in row:
            row[v]["cost_vs_before"] = round(row[v]["draft_ms_per_round"] / base, 3) if base else None
        result["gammas"][gamma] = row
        print(gamma, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
