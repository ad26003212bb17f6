"""Does a block-16 conditioned drafter draft its first slots as well when it is served a shorter block?

The drafter's block attends to itself both ways, so the mask slots past the ones a round uses still feed its first
slots: serving the drafter a block of B' < 16 rows is another function (exact all the same: the target verifies every
token), and costs fewer rows. This scores the drafter at its own block and at each shorter one on the same anchors
(eval-drafter's health check at block min(B'), so every variant is counted over the same slots).

    python short_block_eval.py DRAFTER --blocks 16 8 6 4 --num-prompts 10 --max-new-tokens 256 --out FILE.json
"""
import argparse
import dataclasses
import json
import time

from diffspec.drafter_names import make_drafter
from diffspec.evaluation import evaluate_drafter
from diffspec.target import Target


def served_at(drafter, block: int):
    """The drafter served a block of `block` rows (anchor + block - 1 slots): its config's block size, nothing else."""
    cfg = dataclasses.replace(drafter.model.cfg, block_size=block)
    drafter.model.cfg = cfg
    if getattr(drafter, "cfg", None) is not None and drafter.cfg is not cfg:
        drafter.cfg = cfg
    drafter.default_gamma = drafter.max_tokens_per_round = block - 1
    return drafter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 8, 6, 4])
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--drafter-dtype", default="q8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target = Target.load("smollm2-135m-instruct", quiet=True)
    count_at = min(a.blocks)  # every variant scored over the same anchors and slots
    rows = []
    for block in a.blocks:
        drafter = served_at(make_drafter(a.drafter, target, compute_dtype=a.drafter_dtype), block)
        t = time.perf_counter()
        health = evaluate_drafter(drafter, target, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                                  block_size=count_at)
        d = health.to_dict()
        row = {"served_block": block, "counted_block": count_at, "drafter": health.drafter,
               "seconds": round(time.perf_counter() - t, 1),
               "domains": {k: {"tau": v["tau"], "slot_acceptance": v["slot_acceptance"],
                               "lookup_silent_p1": v["lookup_silent_p1"], "anchors": v["anchors"]}
                           for k, v in d["domains"].items()}}
        rows.append(row)
        print(block, {k: (round(v["tau"], 3), [round(x, 3) for x in v["slot_acceptance"][:3]])
                      for k, v in row["domains"].items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python short_block_eval.py " + " ".join(
            [a.drafter, "--blocks", *map(str, a.blocks), "--num-prompts", str(a.num_prompts), "--max-new-tokens",
             str(a.max_new_tokens), "--drafter-dtype", a.drafter_dtype]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
