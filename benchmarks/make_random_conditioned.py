"""A drafter that is never right, for the auto policy's worst case (issue 17): the shipped conditioned
drafter's architecture (same draft cost) with random weights N(0, 0.02), norms 1.

    python benchmarks/make_random_conditioned.py --out runs/random_cond
    diffspec bench --methods plain combined:drafter=prompt-lookup+runs/random_cond ...
"""

from __future__ import annotations

import argparse

import torch

from diffspec.checkpoint import load_drafter, save_drafter, shipped_drafter_path
from diffspec.target import Target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target = Target.load(None)
    drafter = load_drafter(shipped_drafter_path(target.name, "conditioned"), torch.float32, "cpu")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for name, p in drafter.model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.02)
    save_drafter(drafter, args.out, target_name=target.name, target_vocab_size=target.vocab_size,
                 training={"note": "the shipped drafter's architecture with random weights: never right"})
    print(args.out)


if __name__ == "__main__":
    main()
