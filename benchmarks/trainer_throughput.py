"""Supervised draft slots per second: the per-sequence trainer of commit 27fb4fa against the batched
step, same device, same drafter, same sequences and anchor counts.

    python benchmarks/trainer_throughput.py --data STORE [--device cpu] [--sequences 8] [--steps 4] [--out FILE]

Old: one small forward/backward per sequence inside a step (training/conditioned.py `block_loss`
at 27fb4fa, read from git), target features precomputed (it trained from a feature cache).
New: every anchor of every sequence through one AnchoredLoss forward/backward, measured twice:
with the target pass inside the step (online) and from precomputed features (--feature-cache).
Each is warmed up once, then timed over --steps steps; methods interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch

OLD_COMMIT = "27fb4fa"


def old_module():
    from old_code import module_at

    return module_at(OLD_COMMIT, "src/diffspec/training/conditioned.py",
                     replace=[("from .features import SequenceFeatures", "SequenceFeatures = object")])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from diffspec.devices import host_info, synchronize
    from diffspec.drafters.conditioned import ConditionedConfig, ConditionedDraftModel
    from diffspec.target import Target
    from diffspec.training.anchored import AnchoredLoss
    from diffspec.training.batches import pad_batch, sample_anchors, target_features
    from diffspec.training.conditioned import choose_draft_vocab
    from diffspec.training.run import choose_train_dtype
    from diffspec.training.store import read_store

    dev = args.device
    target = Target.load(None, device=dev, quiet=True)
    store = read_store(args.data)
    seqs = [(ids[: args.seq_len], p) for ids, p in store.sequences if ids[: args.seq_len].shape[0] - p >= 2]
    seqs = seqs[: args.sequences]
    cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=0, num_hidden_layers=args.layers,
                                       block_size=args.block_size, draft_vocab=8192)
    ids, _ = choose_draft_vocab(seqs, 8192, target.vocab_size)
    model = ConditionedDraftModel(cfg).to(dev)
    model.draft_token_ids.copy_(ids)
    amp, why = choose_train_dtype(args.dtype, dev)
    embed, head_w = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach()
    batch = pad_batch(seqs, list(range(len(seqs))), target.tokenizer.pad_token_id or 0).to(dev)
    hidden, nxt = target_features(target.model, batch, cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch, args.anchors, seed=0, epoch=0)
    old = old_module()
    per_seq = []
    for n, (tok, p) in enumerate(seqs):
        T = tok.shape[0]
        f = types.SimpleNamespace(tokens=tok.to(dev), hidden=hidden[n, :T].to(torch.float16), target_next=nxt[n, :T],
                                  first_supervised=p)
        per_seq.append((f, anchors[n][valid[n]].tolist()))
    loss_module = AnchoredLoss(model, "target", 7.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = dict(device_type=torch.device(dev).type, dtype=amp, enabled=amp != torch.float32)

    def step_old() -> int:
        opt.zero_grad()
        slots = 0
        for f, a in per_seq:
            with torch.autocast(**autocast):
                loss, n, _ = old.block_loss(model, f, a, embed, head_w, "target", 7.0)
            (loss / len(per_seq)).backward()
            slots += n
        opt.step()
        return slots

    def step_new(online: bool) -> int:
        opt.zero_grad()
        h, t = (target_features(target.model, batch, cfg.target_layer_ids) if online else (hidden, nxt))
        with torch.autocast(**autocast):
            parts = loss_module(batch.tokens, batch.lengths, h, t, anchors, valid, embed.weight, head_w)
        (parts.weighted_ce / parts.weight).backward()
        opt.step()
        return int(parts.slots)

    methods = {"per-sequence (27fb4fa)": step_old, "batched, online target": lambda: step_new(True),
               "batched, feature cache": lambda: step_new(False)}
    times = {m: [] for m in methods}
    slots = {}
    for m, f in methods.items():  # warm-up
        slots[m] = f()
    for _ in range(args.steps):
        for m, f in methods.items():
            synchronize(dev)
            t0 = time.perf_counter()
            f()
            synchronize(dev)
            times[m].append(time.perf_counter() - t0)
    rows = {m: {"slots_per_step": slots[m], "seconds_per_step": sum(times[m]) / len(times[m]),
                "slots_per_s": slots[m] * len(times[m]) / sum(times[m])} for m in methods}
    base = rows["per-sequence (27fb4fa)"]["slots_per_s"]
    for r in rows.values():
        r["vs_per_sequence"] = r["slots_per_s"] / base
    result = {"command": " ".join(["python"] + sys.argv), "device": dev, "train_dtype": str(amp), "dtype_choice": why,
              "sequences": len(seqs), "response_tokens": int(sum(t.shape[0] - p for t, p in seqs)),
              "anchors": int(valid.sum()), "block_size": args.block_size, "layers": args.layers,
              "machine": host_info(), "methods": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
