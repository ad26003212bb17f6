"""`diffspec train-drafter`: target + corpus -> an aligned drafter folder.

Steps (each resumable: the data cache and the checkpoint live in the output folder):
  1. corpus -> conversations, minus anything that overlaps the evaluation prompt sets;
  2. the target answers `--generate` of the prompts itself (alignment data), within a share of
     the time budget; more conversations are rendered as teacher-forced text;
  3. one target pass per sequence caches hidden states and the target's own next tokens;
  4. train until --steps, --max-time or --max-tokens (supervised slots), checkpointing every
     `checkpoint_every_s`; a killed run restarts from the checkpoint with --resume;
  5. held-out acceptance before/after, the drafter folder, train_log.jsonl, loss.png, training.json.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import save_drafter
from ..drafters.conditioned import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
from ..errors import DiffspecError
from .conditioned import (ConditionedTrainConfig, block_loss, choose_draft_vocab, held_out_acceptance,
                          init_from_target, lr_at, sample_step)
from .data import drop_evaluation_overlap, evaluation_prompts, load_corpus
from ..drafters.block_diffusion import BlockDiffusionConfig, BlockDiffusionDrafter
from .block import block_diffusion_loss, block_held_out_acceptance, make_block_body
from .features import SequenceFeatures, extract_features, generate_responses, render_conversation, render_prompt


@dataclass(frozen=True)
class TrainRequest:
    out: str
    target: Optional[str] = None
    kind: str = "conditioned"
    corpus: str = "sharegpt"
    generate: int = 800             # prompts the target answers itself (alignment data)
    corpus_sequences: int = 1500    # conversations used as teacher-forced text
    response_tokens: int = 160      # max new tokens per generated answer
    seq_len: int = 384              # max tokens per training sequence
    data_time_share: float = 0.4    # at most this share of --max-time goes to generating answers
    max_time: Optional[float] = None    # seconds for the whole command
    max_tokens: Optional[int] = None    # supervised slots
    steps: Optional[int] = None
    block_size: int = 8
    layers: int = 2
    anchors: int = 32
    sequences_per_step: int = 2
    lr: float = 6e-4
    objective: str = "target"
    seed: int = 0
    device: str = "cpu"
    train_dtype: str = "auto"       # matmul precision of training steps: auto (measured) | float32 | bfloat16
    resume: bool = False
    checkpoint_every_s: float = 60.0
    mask_token_id: Optional[int] = None
    draft_vocab: int = 8192         # 0 = the full vocabulary
    init_from_target: bool = True
    quiet: bool = False


def _say(req: TrainRequest, msg: str) -> None:
    if not req.quiet:
        print(f"diffspec train-drafter: {msg}", file=sys.stderr, flush=True)


def _validate(req: TrainRequest) -> None:
    if req.kind not in ("conditioned", "block"):
        raise DiffspecError(f"unknown drafter kind '{req.kind}' (choose from: block, conditioned)")
    if req.objective not in ("target", "corpus"):
        raise DiffspecError(f"unknown objective '{req.objective}' (choose from: target, corpus)")
    if req.steps is None and req.max_time is None and req.max_tokens is None:
        raise DiffspecError("give a budget: --steps, --max-time or --max-tokens")
    for flag, value in (("--steps", req.steps), ("--max-time", req.max_time), ("--max-tokens", req.max_tokens)):
        if value is not None and not value > 0:  # 0 would never end: progress is measured against it
            raise DiffspecError(f"{flag} must be positive, got {value!r}")
    if req.device.startswith("cuda") and not torch.cuda.is_available():
        raise DiffspecError("--device cuda asked for, but torch sees no CUDA device")
    if req.train_dtype not in ("auto", "float32", "bfloat16"):
        raise DiffspecError(f"unknown --train-dtype '{req.train_dtype}' (choose from: auto, float32, bfloat16)")
    if req.block_size < 2 or req.layers < 1 or req.anchors < 1:
        raise DiffspecError("need --block-size >= 2, --layers >= 1, --anchors >= 1")


def build_data(req: TrainRequest, target, layer_ids, deadline: Optional[float]) -> dict:
    """Conversations -> generated + teacher-forced sequences -> cached target features."""
    tok = target.tokenizer
    convs = load_corpus(req.corpus)
    convs, dropped = drop_evaluation_overlap(convs, evaluation_prompts())
    random.Random(req.seed).shuffle(convs)
    _say(req, f"corpus: {len(convs)} conversations ({dropped} dropped for overlapping evaluation prompts)")
    prompts = [p for p in (render_prompt(tok, c, req.seq_len // 2) for c in convs[: req.generate]) if p]
    t0 = time.time()
    gen_deadline = None if deadline is None else t0 + req.data_time_share * (deadline - t0)
    on_cpu = req.device == "cpu"  # a GPU takes far wider batches at about the same step time
    generated = generate_responses(target.model, tok, prompts, req.response_tokens, batch_size=16 if on_cpu else 256,
                                   stop_ids=sorted(target.stop_token_ids), deadline=gen_deadline,
                                   progress=lambda i, n: _say(req, f"target answers {i}/{n}") if i % 64 == 0 else None)
    generated, repeats = drop_repeated_answers(generated)
    if repeats:
        _say(req, f"dropped {repeats} repeated target answers (a repeat in train and held-out would inflate the held-out figure)")
    gen_tokens = sum(len(s) - p for s, p in generated)
    _say(req, f"target generated {len(generated)} answers ({gen_tokens} tokens) in {time.time() - t0:.0f} s")
    teacher = [render_conversation(tok, c, req.seq_len) for c in convs[req.generate: req.generate + req.corpus_sequences]]
    teacher = [(ids, start) for ids, start in teacher if len(ids) - start > 8]
    held = max(2, len(generated) // 20) if len(generated) >= 8 else 0
    t1 = time.time()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    feats = extract_features(target.model, generated + teacher, layer_ids, batch_size=8 if on_cpu else 64, pad_id=pad)
    aligned, other = feats[: len(generated)], feats[len(generated):]
    random.Random(req.seed).shuffle(aligned)  # hold out a random sample of the target's own answers
    _say(req, f"target features for {len(feats)} sequences in {time.time() - t1:.0f} s")
    return {"train": aligned[held:] + other, "held_out": aligned[:held],
            "stats": {"generated_sequences": len(generated), "generated_tokens": gen_tokens,
                      "teacher_forced_sequences": len(teacher),
                      "teacher_forced_tokens": sum(len(i) - s for i, s in teacher),
                      "evaluation_overlap_dropped": dropped, "corpus": req.corpus}}


def choose_train_dtype(requested: str, device: str, width: int = 576, vocab: int = 8192) -> tuple:
    """-> (autocast dtype, why). `auto` measures instead of assuming: bf16 matmuls are ~2x faster than fp32
    on CPUs with AVX512-BF16/AMX and several times slower on AVX2-only ones; on CUDA bf16 is used when supported."""
    if requested != "auto":
        return getattr(torch, requested), "asked for"
    if device.startswith("cuda"):
        ok = torch.cuda.is_bf16_supported()
        return (torch.bfloat16 if ok else torch.float32), ("cuda bf16 supported" if ok else "cuda without bf16")
    a, b = torch.randn(512, width), torch.randn(vocab, width)

    def best(dtype) -> float:
        x, y = a.to(dtype), b.to(dtype)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            x @ y.T
            times.append(time.perf_counter() - t0)
        return min(times[1:])
    fp32, bf16 = best(torch.float32), best(torch.bfloat16)
    why = f"measured {512}x{width}x{vocab} matmul: fp32 {1000 * fp32:.1f} ms, bf16 {1000 * bf16:.1f} ms"
    return (torch.bfloat16 if bf16 * 1.25 < fp32 else torch.float32), why


def drop_repeated_answers(generated: list) -> tuple:
    """[(ids, prompt_len)] -> (first occurrence of each distinct answer, how many were dropped). Small
    targets answer many different prompts with the same line ('Hello! How can I assist you today?')."""
    seen, kept = set(), []
    for ids, start in generated:
        key = tuple(ids[start:])
        if key not in seen:
            seen.add(key)
            kept.append((ids, start))
    return kept, len(generated) - len(kept)


def _save_plot(log: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in log], [r["loss"] for r in log], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE")
    ax.set_title("drafter training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_drafter(req: TrainRequest) -> dict:
    from ..target import Target

    _validate(req)
    machine = machine_info(req.device)  # read at the start: the code that trains is the code checked out now
    t_start = time.time()
    deadline = t_start + req.max_time if req.max_time else None
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(req.seed)
    target = Target.load(req.target, device=req.device, quiet=req.quiet)
    mask = req.mask_token_id if req.mask_token_id is not None else (target.tokenizer.pad_token_id or 0)
    draft_vocab = req.draft_vocab if 0 < req.draft_vocab < target.vocab_size else 0
    cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=mask, num_hidden_layers=req.layers,
                                       block_size=req.block_size, draft_vocab=draft_vocab)
    tcfg = ConditionedTrainConfig(anchors_per_sequence=req.anchors, sequences_per_step=req.sequences_per_step,
                                  lr=req.lr, objective=req.objective)
    data_file = out / "data.pt"
    if data_file.is_file():
        data = torch.load(data_file, weights_only=False)
        data = {k: ([SequenceFeatures(**d) for d in v] if k in ("train", "held_out") else v) for k, v in data.items()}
        _say(req, f"reusing cached target features in {data_file}")
    else:
        data = build_data(req, target, cfg.target_layer_ids, deadline)
        torch.save({k: ([f.to_dict() for f in v] if k in ("train", "held_out") else v) for k, v in data.items()},
                   data_file)
    if not data["train"]:
        raise DiffspecError("no training sequences: the corpus is too small or the budget too short")

    for p in target.model.parameters():
        p.requires_grad_(False)
    trainer = (ConditionedTrainer if req.kind == "conditioned" else BlockTrainer)(req, target, cfg, tcfg, data)
    model = trainer.model
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    state = {"step": 0, "tokens": 0, "elapsed": 0.0, "log": []}
    ckpt = out / "checkpoint.pt"
    if req.resume and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        _say(req, f"resumed from {ckpt} at step {state['step']}")
    before = trainer.held_out() if data["held_out"] else None
    amp_dtype, why = choose_train_dtype(req.train_dtype, req.device)
    _say(req, f"training matmuls in {str(amp_dtype).replace('torch.', '')} ({why})")
    rng = random.Random(req.seed * 1000003 + state["step"])
    last_ckpt = time.time()
    t_loop = time.time() - state["elapsed"]
    # the time budget left for steps (data building already spent part of --max-time); a resumed run
    # continues its schedule: the steps it already did count as spent
    train_budget_s = (deadline - time.time()) + state["elapsed"] if deadline else None

    def progress() -> float:
        """Share of the step budget spent (the lr schedule and the stopping rule both read it)."""
        fr = [state["step"] / req.steps if req.steps else 0.0,
              state["tokens"] / req.max_tokens if req.max_tokens else 0.0,
              (time.time() - t_loop) / max(train_budget_s, 1e-9) if train_budget_s else 0.0]
        return max(fr)

    def checkpoint() -> None:
        state["elapsed"] = time.time() - t_loop
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state}, ckpt)

    model.train()
    while progress() < 1.0:
        lr = lr_at(progress(), tcfg)
        for g in opt.param_groups:
            g["lr"] = lr
        total, slots, accs = 0.0, 0, []
        opt.zero_grad(set_to_none=True)
        batch = trainer.batch(rng)
        for item in batch:
            with torch.autocast(torch.device(req.device).type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                loss, n, acc = trainer.loss(item)
            if loss is None:
                continue
            (loss / len(batch)).backward()
            total += float(loss.detach()) / len(batch)
            slots += n
            accs.append(acc)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        state["step"] += 1
        state["tokens"] += slots
        elapsed = time.time() - t_loop
        state["log"].append({"step": state["step"], "loss": round(total, 4), "slot1_acc": round(sum(accs) / max(1, len(accs)), 3),
                             "lr": lr, "tokens": state["tokens"], "elapsed_s": round(elapsed, 1)})
        if not req.quiet and state["step"] % 20 == 0:
            print(f"\rstep {state['step']}  loss {total:.3f}  slot-1 acc {state['log'][-1]['slot1_acc']:.2f}  "
                  f"{state['tokens'] / max(elapsed, 1e-6):.0f} tok/s  {100 * progress():.0f}%",
                  end="", file=sys.stderr, flush=True)
        if time.time() - last_ckpt > req.checkpoint_every_s:
            checkpoint()
            last_ckpt = time.time()
    checkpoint()
    if not req.quiet:
        print(file=sys.stderr)
    model.eval()
    after = trainer.held_out() if data["held_out"] else None
    record = {"request": asdict(req), "data": data["stats"], "steps": state["step"], "supervised_tokens": state["tokens"],
              "train_seconds": round(state["log"][-1]["elapsed_s"], 1) if state["log"] else 0.0,
              "wall_seconds": round(time.time() - t_start, 1), **trainer.record,
              "held_out_mean_accepted_length_before": before, "held_out_mean_accepted_length_after": after,
              "final_loss": state["log"][-1]["loss"] if state["log"] else None,
              "train_dtype": str(amp_dtype).replace("torch.", ""), "train_dtype_choice": why,
              "machine": machine}
    save_drafter(trainer.drafter(), out / "drafter", target_name=target.name, target_vocab_size=target.vocab_size,
                 training=record)
    with open(out / "train_log.jsonl", "w") as f:
        for row in state["log"]:
            f.write(json.dumps(row) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=1))
    _save_plot(state["log"], out / "loss.png")
    _say(req, f"done: {state['step']} steps, held-out mean accepted length {before} -> {after}; "
              f"drafter in {out / 'drafter'}")
    return record


def machine_info(device: str) -> dict:
    """What the run ran on (recorded with the drafter): bench's machine record, plus the GPU if used."""
    from ..bench.run import machine_info as host_info

    info = host_info()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


class ConditionedTrainer:
    """Target-conditioned drafter: anchors with target features strictly before them."""

    def __init__(self, req: TrainRequest, target, cfg: ConditionedConfig, tcfg: ConditionedTrainConfig, data: dict):
        self.req, self.target, self.tcfg, self.data = req, target, tcfg, data
        coverage = 1.0
        if cfg.draft_vocab:
            ids, coverage = choose_draft_vocab(data["train"], cfg.draft_vocab, always=sorted(target.stop_token_ids))
            cfg = replace(cfg, draft_vocab=int(ids.shape[0]))
        self.model = ConditionedDraftModel(cfg).to(req.device)
        if cfg.draft_vocab:
            self.model.draft_token_ids.copy_(ids)
            _say(req, f"draft vocabulary: {cfg.draft_vocab} tokens cover {100 * coverage:.1f}% of the target's choices")
        copied = init_from_target(self.model, target.model) if req.init_from_target else 0
        self.embed = target.model.get_input_embeddings()
        self.head_w = target.model.get_output_embeddings().weight.detach()
        self.record = {"init_tensors_from_target": copied, "draft_vocab": cfg.draft_vocab,
                       "draft_vocab_coverage": round(coverage, 4)}

    def batch(self, rng: random.Random) -> list:
        return sample_step(rng, self.data["train"], self.tcfg)

    def loss(self, item) -> tuple:
        seq, anchors = item
        return block_loss(self.model, seq, anchors, self.embed, self.head_w, self.tcfg.objective, self.tcfg.slot_decay)

    def held_out(self) -> float:
        return held_out_acceptance(self.model, self.data["held_out"], self.embed, self.head_w)

    def drafter(self):
        return ConditionedDrafter(self.model.to(torch.float32), self.target.tokenizer_fingerprint)


class BlockTrainer:
    """Standalone block-diffusion drafter: two-copy masked block objective (training/block.py)."""

    def __init__(self, req: TrainRequest, target, cfg: ConditionedConfig, tcfg: ConditionedTrainConfig, data: dict):
        self.req, self.target, self.tcfg, self.data = req, target, tcfg, data
        self.model, self.mask_id = make_block_body(target.model, req.layers)
        self.model.to(req.device).train()
        self.record = {"init": "target embeddings, LM head, evenly spaced layers, final norm",
                       "layers": req.layers, "mask_token_id": self.mask_id}

    def batch(self, rng: random.Random) -> list:
        train = self.data["train"]
        return [(train[rng.randrange(len(train))], rng) for _ in range(self.tcfg.sequences_per_step)]

    def loss(self, item) -> tuple:
        seq, rng = item
        return block_diffusion_loss(self.model, seq, self.req.block_size, self.mask_id, self.tcfg.objective, rng,
                                    max_len=self.req.seq_len)

    def drafter(self):
        return BlockDiffusionDrafter(self.model.float().eval(), BlockDiffusionConfig(
            mask_token_id=self.mask_id, block_size=self.req.block_size,
            sub_block_size=min(8, self.req.block_size)), self.target.tokenizer_fingerprint)

    def held_out(self) -> float:
        was_training = self.model.training
        d = self.drafter()
        d.attach(self.target)
        value = block_held_out_acceptance(d, self.data["held_out"])
        self.model.train(was_training)
        return value
