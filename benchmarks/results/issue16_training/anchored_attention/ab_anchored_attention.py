"""A/B of the conditioned trainer's anchored attention (training/anchored.py): the kept code against the
version before it (ANCHORED_OLD: that file at an older commit, e.g. `git show 2791af4:src/diffspec/training/anchored.py`),
interleaved in one process on the same batches: the drafter's forward + loss + backward under the trainer's
autocast, the target's features computed once beforehand (they do not depend on the attention).

    git show 2791af4:src/diffspec/training/anchored.py > /tmp/anchored_old.py
    ANCHORED_OLD=/tmp/anchored_old.py python ab_anchored_attention.py --data STORE --out ab.json
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

from diffspec.training import anchored
from diffspec.training.batches import pad_batch
from diffspec.training.distributed import World
from diffspec.training.run import ConditionedTrainer, TrainRequest, choose_train_dtype, load_training_data
from diffspec.target import Target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--batch-sequences", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("diffspec.training.anchored_old", os.environ["ANCHORED_OLD"])
    old = importlib.util.module_from_spec(spec)
    old.__package__ = "diffspec.training"  # its relative imports
    sys.modules[spec.name] = old           # (dataclasses look their module up)
    spec.loader.exec_module(old)
    versions = {"before": old.anchored_attention, "after": anchored.anchored_attention}
    req = TrainRequest(out="/tmp/ab_anchored", data=a.data, init_drafter="shipped", block_size=16, anchors=a.anchors,
                       batch_sequences=a.batch_sequences, quiet=True, eval_prompts=0, held_out=8)
    target = Target.load(None, quiet=True)
    train, _, _ = load_training_data(req, target, World(), None)
    trainer = ConditionedTrainer(req, target, train, "cpu")
    amp, why = choose_train_dtype("auto", "cpu")
    pad = target.tokenizer.pad_token_id or 0
    longest = sorted(range(len(train)), key=lambda i: -int(train[i][0].shape[0]))
    batches = []
    for b in range(a.batches):
        idx = longest[b * a.batch_sequences * 7: b * a.batch_sequences * 7 + a.batch_sequences]
        batches.append(trainer.inputs(pad_batch([train[i] for i in idx], idx, pad), 0))
    times = {k: [] for k in versions}
    losses = {k: [] for k in versions}
    trainer.model.train()
    for turn in range(a.turns + 1):  # the first turn warms up
        for name, fn in (versions.items() if turn % 2 == 0 else reversed(list(versions.items()))):
            anchored.anchored_attention = fn
            for inputs in batches:
                trainer.model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=amp, enabled=amp != torch.float32):
                    parts = trainer.loss_module(*inputs)
                (parts.weighted_ce / parts.weight).backward()
                dt = time.perf_counter() - t0
                if turn:
                    times[name].append(dt)
                    losses[name].append(float(parts.weighted_ce / parts.weight))
    anchored.anchored_attention = versions["after"]
    report = {"train_dtype": str(amp), "why": why, "anchors": a.anchors, "batch_sequences": a.batch_sequences,
              "batches": a.batches, "turns": a.turns,
              "sequence_tokens": [int(inp[0].shape[1]) for inp in batches],
              "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
              "min_s": {k: round(min(v), 3) for k, v in times.items()},
              "loss_max_abs_diff": max(abs(x - y) for x, y in zip(losses["before"], losses["after"]))}
    report["speedup_median"] = round(report["median_s"]["before"] / report["median_s"]["after"], 3)
    print(json.dumps(report, indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
