"""A/B of one conditioned training step: the LM head on every block row (commit af9a88f's AnchoredLoss,
read from git) against the head on the supervised rows only (the working tree's), same batches,
interleaved; and the anchor count per sequence, since the target's pass over a batch is paid once
whatever the number of anchors drawn from it.

    python ab_head_rows.py --data STORE --out OUT.json [--anchors 64 256 512] [--batches 4] [--turns 2]

Each step: the target's features of the batch (online, as train-drafter runs on a corpus store), one
AnchoredLoss forward/backward under bf16 autocast (what `--dtype auto` chose here), an AdamW step.
The drafter starts from the shipped one at block 16; its weights are restored before every step, so
both variants see the same model. Times are per phase: target features, drafter forward+backward+step."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import diffspec
from diffspec.checkpoint import load_drafter
from diffspec.devices import host_info
from diffspec.drafters.conditioned import ConditionedDraftModel
from diffspec.target import Target
from diffspec.training.anchored import AnchoredLoss
from diffspec.training.batches import pad_batch, sample_anchors, target_features
from diffspec.training.store import read_store

OLD = "af9a88f"
REPO = Path(diffspec.__file__).resolve().parents[2]


def old_loss_class():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from old_code import module_at

    return module_at(OLD, "src/diffspec/training/anchored.py").AnchoredLoss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    target = Target.load(None, device="cpu", quiet=True)
    loaded = load_drafter(Path(diffspec.__file__).parent / "weights/smollm2-135m-instruct/conditioned")
    cfg = replace(loaded.model.cfg, block_size=16)
    model = ConditionedDraftModel(cfg)
    model.load_state_dict(loaded.model.state_dict())
    model = model.float()
    start = copy.deepcopy(model.state_dict())
    store = read_store(args.data)
    seqs = [(ids[: args.seq_len], p) for ids, p in store.sequences[:400] if ids[: args.seq_len].shape[0] - p >= 64]
    batches = [pad_batch(seqs[2 * i: 2 * i + 2], [2 * i, 2 * i + 1], target.tokenizer.pad_token_id or 0)
               for i in range(args.batches)]
    embed_w = target.model.get_input_embeddings().weight.detach()
    head_w = target.model.get_output_embeddings().weight.detach()
    variants = {"all rows (af9a88f)": old_loss_class()(model, "target", 7.0),
                "supervised rows": AnchoredLoss(model, "target", 7.0)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(loss_module, batch, n_anchors):
        model.load_state_dict(start)
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden, nxt = target_features(target.model, batch, cfg.target_layer_ids)
        t1 = time.perf_counter()
        anchors, valid = sample_anchors(batch, n_anchors, seed=0, epoch=0)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts = loss_module(batch.tokens, batch.lengths, hidden, nxt, anchors, valid, embed_w, head_w)
        (parts.weighted_ce / parts.weight).backward()
        opt.step()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, int(parts.slots), int(valid.sum()), float(parts.weighted_ce / parts.weight)

    rows = []
    for name, lm in variants.items():   # warm-up
        step(lm, batches[0], args.anchors[0])
    for turn in range(args.turns):
        for n_anchors in args.anchors:
            for b, batch in enumerate(batches):
                for name, lm in variants.items():
                    tf, td, slots, anchors, loss = step(lm, batch, n_anchors)
                    rows.append(dict(turn=turn, anchors_per_sequence=n_anchors, batch=b, variant=name, target_s=tf,
                                     drafter_s=td, supervised_slots=slots, anchors=anchors, loss=loss))
                    print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for n_anchors in args.anchors:
        for name in variants:
            r = [x for x in rows if x["anchors_per_sequence"] == n_anchors and x["variant"] == name]
            tf, td = sum(x["target_s"] for x in r), sum(x["drafter_s"] for x in r)
            slots = sum(x["supervised_slots"] for x in r)
            summary[f"{n_anchors} anchors, {name}"] = dict(
                steps=len(r), target_s_per_step=round(tf / len(r), 3), drafter_s_per_step=round(td / len(r), 3),
                step_s=round((tf + td) / len(r), 3), supervised_slots_per_step=slots / len(r),
                anchors_per_step=sum(x["anchors"] for x in r) / len(r), slots_per_s=round(slots / (tf + td), 1))
    out = dict(command=" ".join(["python"] + sys.argv), machine=host_info(), old_commit=OLD,
               losses_equal=all(abs(a["loss"] - b["loss"]) < 1e-2 * max(1.0, abs(a["loss"]))
                                for a, b in zip(rows[::2], rows[1::2])), summary=summary, rows=rows)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
