"""`diffspec train-drafter`: a target + the target's own answers -> an aligned drafter folder.

Steps (data, training and evaluation are separate; one format between them, the token store):
  1. data: `--data STORE` (written by `diffspec make-data`), or a store built here in OUT/data within
     a share of --max-time; a random sample of its sequences is held out;
  2. training, counted in epochs over the store (--steps, --max-tokens, --max-time stop it earlier):
     each step takes a global batch of sequences, runs the frozen target over them (hidden states of
     the chosen layers and its own next-token labels; `--feature-cache` keeps them in memory for the
     next epochs), and puts every anchor of every sequence through ONE drafter forward/backward
     (training/anchored.py; the block kind: training/block.py). Under torchrun every rank takes its
     share of the global batch and DDP averages the gradients (training/distributed.py). A
     checkpoint every `checkpoint_every_s`; --resume continues at the same step;
  3. the drafter folder, train_log.jsonl, loss.png, and the health check (evaluation.py) on the
     held-out sequences and on the three evaluation sets, written into training.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..checkpoint import save_drafter
from ..devices import check_device_available
from ..drafters.block_diffusion import BlockDiffusionConfig, BlockDiffusionDrafter
from ..drafters.conditioned import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
from ..errors import DiffspecError
from ..timing import min_seconds
from .anchored import AnchoredLoss
from .batches import PaddedBatch, epoch_batches, pad_batch, rank_share, sample_anchors, target_features
from .block import BlockDiffusionLoss, make_block_body, noise_batch
from .conditioned import (FC_INITS, choose_draft_vocab, draft_vocab_coverage, init_from_target, lr_at,
                          pass_lowest_layer_through, response_token_counts)
from .distributed import World, all_max, all_sum, barrier, join_world, leave_world, wrap
from .step_profile import StepProfile


@dataclass(frozen=True)
class TrainRequest:
    out: str
    target: Optional[str] = None
    kind: str = "conditioned"
    data: Optional[str] = None          # a token store (diffspec make-data); None: build one in OUT/data
    corpus: str = "sharegpt"            # what the store is built from when --data is not given
    max_prompts: Optional[int] = None   # prompts the target answers when building the store (None: all)
    response_tokens: int = 256          # max new tokens per answer when building the store
    data_time_share: float = 0.4        # at most this share of --max-time goes to building the store
    data_fraction: float = 1.0          # train on this share of the store (nested: a smaller share is a subset)
    seq_len: int = 1024                 # max tokens per training sequence
    epochs: float = 3.0
    max_time: Optional[float] = None    # seconds for the whole command
    max_tokens: Optional[int] = None    # supervised slots
    steps: Optional[int] = None
    block_size: int = 16
    layers: Optional[int] = None        # drafter layers (None: 2, or those of init_drafter)
    anchors: int = 512                  # anchors per sequence per step (at most)
    batch_sequences: int = 8            # sequences per optimizer step (the global batch)
    lr: float = 6e-4
    warmup: float = 0.04
    slot_decay: float = 7.0             # slot weights exp(-(k-1)/slot_decay)
    grad_clip: float = 1.0
    weight_decay: float = 0.01
    objective: str = "target"
    off_path_slots: bool = False        # also supervise slots after a data token the target would not choose (anchored.py)
    seed: int = 0
    device: str = "cpu"
    train_dtype: str = "auto"           # matmul precision of training steps: auto (measured) | float32 | bfloat16
    feature_cache: bool = False         # keep the target's features of each sequence after its first use
    resume: bool = False
    checkpoint_every_s: float = 60.0
    mask_token_id: Optional[int] = None
    draft_vocab: Optional[int] = None   # draft tokens (0 = the full vocabulary; None: 8192, or init_drafter's)
    init_from_target: bool = True
    fc_init: Optional[str] = None       # conditioned kind from the target: fc lowest-layer or random (None: DEFAULT_FC_INIT)
    init_drafter: Optional[str] = None  # start from this conditioned drafter (a folder, or 'shipped'): its shape and weights
    lookup_hints: Optional[bool] = None  # conditioned kind: prompt lookup's copy in the block (None: off, or init_drafter's)
    held_out: int = 64                  # store sequences held out (at most; ~5% of a small store)
    eval_prompts: int = 10              # health check: prompts per evaluation set (0: skip)
    eval_tokens: int = 128              # health check: tokens the target answers per prompt
    eval_anchors: Optional[int] = 32    # health check: evenly spaced anchors per answer (None: every position)
    profile_steps: int = 0              # profile this many training steps (step_profile.py: OUT/profile_steps.txt)
    quiet: bool = False


# what a resumed run must share with the run that wrote the checkpoint (the batches, anchors and model depend on them)
RESUME_FIELDS = ("kind", "data_fraction", "seq_len", "block_size", "layers", "anchors", "batch_sequences", "seed",
                 "objective", "off_path_slots", "draft_vocab", "held_out", "init_drafter", "lookup_hints")
DEFAULT_LAYERS, DEFAULT_DRAFT_VOCAB, DEFAULT_FC_INIT = 2, 8192, "lowest-layer"
DISTILL_TOP_K = 32  # --objective distill: the target's K most likely tokens per position (renormalised) are the label


def _say(req: TrainRequest, msg: str, world: World = World()) -> None:
    if not req.quiet and world.main:
        print(f"diffspec train-drafter: {msg}", file=sys.stderr, flush=True)


def validate(req: TrainRequest) -> None:
    """Every parameter checked before anything slow (a model load, a data build) starts."""
    if req.kind not in ("conditioned", "block"):
        raise DiffspecError(f"unknown drafter kind '{req.kind}' (choose from: block, conditioned)")
    if req.objective not in ("target", "corpus", "distill"):
        raise DiffspecError(f"unknown objective '{req.objective}' (choose from: corpus, distill, target)")
    if req.objective == "distill" and req.kind != "conditioned":
        raise DiffspecError("--objective distill applies to --kind conditioned (the block kind trains on hard labels)")
    if req.fc_init is not None:
        if req.fc_init not in FC_INITS:
            raise DiffspecError(f"unknown --fc-init '{req.fc_init}' (choose from: {', '.join(FC_INITS)})")
        if req.kind != "conditioned" or req.init_drafter is not None or not req.init_from_target:
            raise DiffspecError("--fc-init applies to --kind conditioned started from the target (not with "
                                "--init-drafter or --no-init-from-target)")
    if req.lookup_hints and req.kind != "conditioned":
        raise DiffspecError("--lookup-hints applies to --kind conditioned (the block kind denoises its own block)")
    if req.off_path_slots and (req.kind != "conditioned" or req.objective == "corpus"):
        raise DiffspecError("--off-path-slots applies to --kind conditioned with --objective target or distill (the "
                            "block kind sees the data's tokens in its block; corpus labels are the data itself)")
    for flag, value in (("--steps", req.steps), ("--max-time", req.max_time), ("--max-tokens", req.max_tokens),
                        ("--epochs", req.epochs)):
        if value is not None and not value > 0:  # 0 would never end: progress is measured against it
            raise DiffspecError(f"{flag} must be positive, got {value!r}")
    check_device_available(req.device)
    if req.train_dtype not in ("auto", "float32", "bfloat16"):
        raise DiffspecError(f"unknown --train-dtype '{req.train_dtype}' (choose from: auto, float32, bfloat16)")
    if req.block_size < 2 or (req.layers is not None and req.layers < 1) or req.anchors < 1 or req.batch_sequences < 1:
        raise DiffspecError("need --block-size >= 2, --layers >= 1, --anchors >= 1, --batch-sequences >= 1")
    if req.seq_len < req.block_size + 1:
        raise DiffspecError(f"--seq-len {req.seq_len} leaves no room for a block of {req.block_size}")
    if not req.slot_decay > 0 or not req.lr > 0 or not 0 <= req.warmup < 1:
        raise DiffspecError("need --slot-decay > 0, --lr > 0 and 0 <= --warmup < 1")
    if not req.grad_clip > 0:  # NaN too: clipping to NaN made every weight NaN, and the run said done
        raise DiffspecError(f"--grad-clip must be > 0 (inf: no clipping), got {req.grad_clip}")
    from ..cli_options import check_out_folder

    check_out_folder(req.out)
    out = Path(req.out).expanduser()
    if not req.resume and (out / "checkpoint.pt").is_file():  # started over and replaced it, drafter and all
        raise DiffspecError(f"--out {req.out} holds a training run (checkpoint.pt): --resume continues it; another "
                            f"--out starts a new one")
    if req.held_out < 0 or req.eval_prompts < 0 or req.eval_tokens < 2:
        raise DiffspecError("need --held-out >= 0, --eval-prompts >= 0 and --eval-tokens >= 2")
    if req.eval_anchors is not None and req.eval_anchors < 1:
        raise DiffspecError(f"--eval-anchors must be positive, got {req.eval_anchors}")
    if req.profile_steps < 0:
        raise DiffspecError(f"--profile-steps must be 0 or more, got {req.profile_steps}")
    if not 0 < req.data_fraction <= 1:
        raise DiffspecError(f"--data-fraction must be in (0, 1], got {req.data_fraction}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and req.data is None:
        raise DiffspecError("under torchrun give --data STORE (make it first with `diffspec make-data`): one rank "
                            "building the store while the others wait would outlast the process group's timeout")
    if req.batch_sequences < world:
        raise DiffspecError(f"--batch-sequences {req.batch_sequences} is smaller than the {world} processes")
    if req.draft_vocab is not None and req.draft_vocab < 0:
        raise DiffspecError(f"--draft-vocab must be >= 0, got {req.draft_vocab}")
    if req.init_drafter is not None:
        init_drafter_config(req)  # a missing folder or a mismatched shape is named before the target loads
    if req.feature_cache and req.kind != "conditioned":
        raise DiffspecError("--feature-cache applies to --kind conditioned (the block kind reads no target features)")
    if req.eval_prompts:
        from ..datasets import SETS
        from ..packages import package_file
        for name in SETS:  # the health check at the end must not fail after the training
            package_file(*SETS[name])
    if req.data is not None:
        from .store import read_store
        read_store(req.data)  # reads the manifest only: a missing or foreign folder is named now, not after the model loads
    elif req.max_prompts is not None and req.max_prompts < 1:
        raise DiffspecError(f"--max-prompts must be positive, got {req.max_prompts}")


def init_drafter_path(req: TrainRequest) -> Path:
    """The folder --init-drafter names: a path, or 'shipped' (the drafter that ships for the target)."""
    from ..checkpoint import shipped_drafter_path
    from ..models import DEFAULT_MODEL

    if req.init_drafter == "shipped":
        path = shipped_drafter_path(req.target or DEFAULT_MODEL, "conditioned")
        if path is None:
            raise DiffspecError(f"--init-drafter shipped: no conditioned drafter ships for {req.target or DEFAULT_MODEL}")
        return path
    return Path(req.init_drafter).expanduser()


def init_drafter_config(req: TrainRequest) -> dict:
    """--init-drafter's config.json, checked against the request: a conditioned diffspec drafter whose
    layer count and draft vocabulary are the ones asked for (when asked). -> the config."""
    from ..checkpoint import _read_config

    if req.kind != "conditioned":
        raise DiffspecError("--init-drafter applies to --kind conditioned")
    if req.init_from_target is False:
        raise DiffspecError("--init-drafter and --no-init-from-target ask for two different starts: give one")
    path = init_drafter_path(req)
    config = _read_config(path)
    meta = config.get("diffspec") or {}
    if meta.get("kind") != "conditioned":
        raise DiffspecError(f"--init-drafter {path}: not a conditioned diffspec drafter (kind {meta.get('kind')!r})")
    theirs = {"--layers": config.get("num_hidden_layers"), "--draft-vocab": int(meta.get("draft_vocab", 0))}
    for flag, asked in (("--layers", req.layers), ("--draft-vocab", req.draft_vocab)):
        if asked is not None and asked != theirs[flag]:
            raise DiffspecError(f"{flag} {asked} differs from the drafter --init-drafter loads ({path}: "
                                f"{flag} {theirs[flag]}); leave {flag} out to keep the drafter's")
    return config


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
        return min_seconds(lambda: x @ y.T, repeats=4)
    fp32, bf16 = best(torch.float32), best(torch.bfloat16)
    why = f"measured {512}x{width}x{vocab} matmul: fp32 {1000 * fp32:.1f} ms, bf16 {1000 * bf16:.1f} ms"
    return (torch.bfloat16 if bf16 * 1.25 < fp32 else torch.float32), why


def load_training_data(req: TrainRequest, target, world: World, deadline: Optional[float]) -> tuple:
    """-> (train [(ids, prompt_len)], held-out [(ids, prompt_len)], the store's manifest)."""
    from .data import load_corpus
    from .store import build_store, read_store

    path = Path(req.data) if req.data else Path(req.out) / "data"
    if req.data is None and world.main:
        t0 = time.time()
        gen_deadline = None if deadline is None else t0 + req.data_time_share * (deadline - t0)
        build_store(path, target, load_corpus(req.corpus), max_new_tokens=req.response_tokens,
                    max_prompts=req.max_prompts, seed=req.seed, deadline=gen_deadline, progress=not req.quiet,
                    corpus=req.corpus)
    barrier(world)
    store = read_store(path)
    theirs = store.manifest.get("tokenizer_fingerprint")
    if theirs and target.tokenizer_fingerprint and theirs != target.tokenizer_fingerprint:
        raise DiffspecError(f"the token store {path} was made with another tokenizer ({theirs}) than the target's "
                            f"({target.tokenizer_fingerprint}): its ids mean other tokens")
    seqs = [(ids[: req.seq_len], p) for ids, p in store.sequences]
    seqs = [(ids, p) for ids, p in seqs if ids.shape[0] - p >= 2]   # at least one supervised anchor
    if not seqs:
        raise DiffspecError(f"the token store {path} holds no answer to train on")
    # held out by prompt, never by sequence: a prompt answered at several temperatures has all its
    # answers on one side (the held-out check regenerates the greedy answer of each held-out prompt)
    groups: dict = {}
    for i, (ids, p) in enumerate(seqs):
        groups.setdefault(tuple(ids[:p].tolist()), []).append(i)
    prompts = list(groups.values())
    g = torch.Generator().manual_seed(req.seed)
    order = torch.randperm(len(prompts), generator=g).tolist()
    held = min(req.held_out, max(2, len(prompts) // 20)) if len(prompts) >= 8 else 0
    # held out first, then the share: every --data-fraction keeps the same held-out set, and a smaller
    # share is a subset of a larger one (the scaling ladder compares like with like)
    rest = [i for k in order[held:] for i in prompts[k]]
    train = [seqs[i] for i in rest[: max(1, round(req.data_fraction * len(rest)))]]
    return train, [seqs[prompts[k][0]] for k in order[:held]], store.manifest


class ConditionedTrainer:
    """Target-conditioned drafter: every anchor of the batch through one AnchoredLoss forward."""

    def __init__(self, req: TrainRequest, target, train: list, device: str):
        self.req, self.target, self.device = req, target, device
        mask = req.mask_token_id if req.mask_token_id is not None else (target.tokenizer.pad_token_id or 0)
        self.record = {}
        if req.init_drafter is not None:
            self.model, cfg, coverage = self._from_drafter(target, train, device)
            copied = 0
        else:
            ids, coverage = _draft_ids(req, target, train)
            cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=mask,
                                               num_hidden_layers=req.layers or DEFAULT_LAYERS,
                                               block_size=req.block_size, draft_vocab=0 if ids is None else ids.numel(),
                                               lookup_hints=bool(req.lookup_hints))
            self.model = ConditionedDraftModel(cfg).to(device)
            if ids is not None:
                self.model.draft_token_ids.copy_(ids)
            copied = 0
            if req.init_from_target:
                copied = init_from_target(self.model, target.model)
                if (req.fc_init or DEFAULT_FC_INIT) == "lowest-layer":
                    self.record["fc_init"] = f"lowest-layer (target layer {pass_lowest_layer_through(self.model)})"
        self.layer_ids = cfg.target_layer_ids
        self.embed_weight = target.model.get_input_embeddings().weight.detach()
        self.head_weight = target.model.get_output_embeddings().weight.detach()
        self.loss_module = AnchoredLoss(self.model, req.objective, req.slot_decay,
                                        greedy_path_only=not req.off_path_slots)
        self.cache: dict = {}
        self.record.update({"init_tensors_from_target": copied, "layers": cfg.num_hidden_layers,
                            "draft_vocab": cfg.draft_vocab, "lookup_hints": cfg.lookup_hints,
                            "draft_vocab_coverage": round(coverage, 4), "target_layer_ids": list(cfg.target_layer_ids)})

    def _from_drafter(self, target, train: list, device: str) -> tuple:
        """--init-drafter: its shape (layers, target layers, draft vocabulary, mask token) and weights; the
        block size is this run's (the weights do not depend on it). -> (model, config, draft vocab coverage)."""
        from ..checkpoint import load_drafter

        path = init_drafter_path(self.req)  # checked against the request by validate()
        loaded = load_drafter(path)
        loaded.check_tokenizer(target)
        if self.req.mask_token_id is not None and self.req.mask_token_id != loaded.model.cfg.mask_token_id:
            raise DiffspecError(f"--mask-token-id {self.req.mask_token_id} differs from the drafter's "
                                f"({loaded.model.cfg.mask_token_id}, {path})")
        tcfg, dcfg = target.model.config.get_text_config(decoder=True), loaded.model.cfg
        for what, theirs, ours in (("layers", dcfg.num_target_layers, tcfg.num_hidden_layers),
                                   ("hidden size", dcfg.hidden_size, tcfg.hidden_size),
                                   ("vocabulary", dcfg.vocab_size, tcfg.vocab_size)):
            if theirs != ours:
                raise DiffspecError(f"--init-drafter {path} was made for a target with {what} {theirs}; this "
                                    f"target has {ours}")
        cfg = replace(loaded.model.cfg, block_size=self.req.block_size,
                      lookup_hints=loaded.model.cfg.lookup_hints if self.req.lookup_hints is None else self.req.lookup_hints)
        model = ConditionedDraftModel(cfg)
        model.load_state_dict(loaded.model.state_dict())
        coverage = draft_vocab_coverage(response_token_counts(train, target.vocab_size), model.draft_token_ids) \
            if cfg.draft_vocab else 1.0
        self.record["init_drafter"] = str(path)
        return model.float().to(device), cfg, coverage

    def features(self, batch: PaddedBatch) -> tuple:
        """The target's features and labels for the batch (and its top-K distributions under --objective
        distill, else None, None): one target pass, or the feature cache."""
        idx = batch.index.tolist()
        distill = self.req.objective == "distill"
        if not (self.req.feature_cache and all(i in self.cache for i in idx)):
            draft_ids = self.model.draft_token_ids if self.model.cfg.draft_vocab else None
            out = target_features(self.target.model, batch, self.layer_ids, top_k=DISTILL_TOP_K if distill else 0,
                                  draft_ids=draft_ids)
            hidden, nxt = out[0], out[1]
            probs, index = out[2] if distill else (None, None)
            if not self.req.feature_cache:
                return hidden, nxt, probs, index
            for row, i in enumerate(idx):
                n = int(batch.lengths[row])
                soft = (probs[row, :n].to(torch.bfloat16).cpu(), index[row, :n].to(torch.int32).cpu()) if distill else None
                self.cache[i] = (hidden[row, :n].to(torch.bfloat16).cpu(), nxt[row, :n].cpu(), soft)
        L = batch.tokens.shape[1]
        hidden = torch.zeros(len(idx), L, self.cache[idx[0]][0].shape[-1], dtype=torch.bfloat16)
        nxt = torch.zeros(len(idx), L, dtype=torch.long)
        probs = torch.zeros(len(idx), L, DISTILL_TOP_K) if distill else None
        index = torch.zeros(len(idx), L, DISTILL_TOP_K, dtype=torch.long) if distill else None
        for row, i in enumerate(idx):
            h, t, soft = self.cache[i]
            hidden[row, : h.shape[0]], nxt[row, : t.shape[0]] = h, t
            if distill:
                k = soft[0].shape[-1]
                probs[row, : h.shape[0], :k], index[row, : h.shape[0], :k] = soft[0].float(), soft[1].long()
        to = (lambda t: None if t is None else t.to(self.device))
        return to(hidden), to(nxt), to(probs), to(index)

    def inputs(self, batch: PaddedBatch, epoch: int) -> tuple:
        hidden, nxt, probs, index = self.features(batch)
        anchors, valid = sample_anchors(batch, self.req.anchors, self.req.seed, epoch)
        return (batch.tokens, batch.lengths, hidden, nxt, anchors, valid, self.embed_weight, self.head_weight,
                probs, index)

    def drafter(self):
        return ConditionedDrafter(self.model.float().eval(), self.target.tokenizer_fingerprint)


def _asked_draft_vocab(req: TrainRequest) -> int:
    return DEFAULT_DRAFT_VOCAB if req.draft_vocab is None else req.draft_vocab


def _draft_ids(req: TrainRequest, target, train: list) -> tuple:
    """A new drafter's reduced draft vocabulary: the tokens the target emits most in `train`, plus its stop
    tokens. -> (sorted ids, or None for the whole vocabulary; share of response tokens they cover)."""
    asked = _asked_draft_vocab(req)
    if not 0 < asked < target.vocab_size:
        return None, 1.0
    return choose_draft_vocab(train, asked, target.vocab_size, sorted(target.stop_token_ids))


class BlockTrainer:
    """Standalone block-diffusion drafter: the two-copy masked objective over the whole batch at once."""

    def __init__(self, req: TrainRequest, target, train: list, device: str):
        self.req, self.target, self.device = req, target, device
        self.model, self.mask_id = make_block_body(target.model, req.layers or DEFAULT_LAYERS)
        self.model.to(device).train()
        self.draft_ids, coverage = _draft_ids(req, target, train)  # the head is most of a drafting step
        self.loss_module = BlockDiffusionLoss(self.model, req.block_size, req.objective, self.draft_ids)
        self.record = {"init": "target embeddings, LM head, evenly spaced layers, final norm",
                       "layers": req.layers or DEFAULT_LAYERS, "mask_token_id": self.mask_id,
                       "draft_vocab": 0 if self.draft_ids is None else int(self.draft_ids.numel()),
                       "draft_vocab_coverage": round(coverage, 4)}

    def inputs(self, batch: PaddedBatch, epoch: int) -> tuple:
        B = self.req.block_size
        T = max(B, math.ceil(batch.tokens.shape[1] / B) * B)
        clean = F.pad(batch.tokens, (0, T - batch.tokens.shape[1]), value=0)
        with torch.no_grad():
            _, nxt = target_features(self.target.model, batch, None)
        nxt = F.pad(nxt, (0, T - nxt.shape[1]), value=0)
        seeds = [(self.req.seed * 1_000_003 + epoch) * 2_000_029 + int(i) for i in batch.index]
        noisy, masked = noise_batch(clean, B, self.mask_id, seeds)
        masked &= torch.arange(T, device=clean.device)[None] < batch.lengths[:, None]
        return (clean, noisy, masked, batch.lengths, batch.first_supervised, nxt)

    def drafter(self):
        return BlockDiffusionDrafter(self.model.float().eval(), BlockDiffusionConfig(
            mask_token_id=self.mask_id, block_size=self.req.block_size,
            sub_block_size=min(8, self.req.block_size)), self.target.tokenizer_fingerprint,
            draft_token_ids=self.draft_ids)


def _parts(out) -> tuple:
    """LossParts (conditioned) or the block loss's tuple -> (weighted CE, weight, slots, slot-1 correct, count)."""
    if isinstance(out, tuple):
        return out
    return out.weighted_ce, out.weight, out.slots, out.slot1_correct, out.slot1_count


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
    validate(req)
    world = join_world(req.device)
    try:
        result = _train(req, world)
        barrier(world)  # every rank leaves together (rank 0 may still be writing the drafter)
        return result
    finally:
        leave_world(world)


def _train(req: TrainRequest, world: World) -> dict:
    from ..target import Target

    machine = machine_info(world.device) if world.main else {}
    t_start = time.time()
    deadline = t_start + req.max_time if req.max_time else None
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Target.load(req.target, device=world.device, quiet=req.quiet or not world.main)
    for p in target.model.parameters():
        p.requires_grad_(False)
    train, held, manifest = load_training_data(req, target, world, deadline)
    _say(req, f"{len(train)} training sequences ({sum(int(i.shape[0]) - p for i, p in train)} response tokens), "
              f"{len(held)} held out", world)
    # seeded here, right before the drafter's random init: loading the target and the data may draw from the
    # global generator a different number of times in a process's first run than in its next (lazy imports,
    # cached loads), which made two identical runs in one process start from different weights
    torch.manual_seed(req.seed)
    trainer = (ConditionedTrainer if req.kind == "conditioned" else BlockTrainer)(req, target, train, world.device)
    trainer.record.update(train_sequences=len(train), train_response_tokens=sum(int(i.shape[0]) - p for i, p in train),
                          held_out_sequences=len(held))
    model = trainer.model
    module = wrap(trainer.loss_module, world)
    opt = torch.optim.AdamW(model.parameters(), lr=req.lr, weight_decay=req.weight_decay, betas=(0.9, 0.95))
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "tokens": 0, "anchors": 0, "elapsed": 0.0, "log": []}
    ckpt = out / "checkpoint.pt"
    same_run = {k: getattr(req, k) for k in RESUME_FIELDS}
    # the shape the run has, not how it was asked for (--layers 2 and no --layers are the same run)
    same_run.update(layers=trainer.record["layers"],
                    draft_vocab=trainer.record["draft_vocab"] if req.init_drafter is not None
                    else _asked_draft_vocab(req), lookup_hints=trainer.record.get("lookup_hints", False))
    same_run["data"] = str(Path(req.data).resolve()) if req.data else None
    if req.resume and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False, map_location=world.device)
        before = dict(saved.get("same_run", {}))
        before.setdefault("lookup_hints", False)  # written before lookup hints existed: none
        if "off_path_slots" not in before:  # written before on-path labels: it trained every slot, and a block
            before["off_path_slots"] = req.kind == "conditioned"  # drafter then drafted the whole vocabulary
            if req.kind == "block":
                before["draft_vocab"] = 0
        changed = {k: (before.get(k), v) for k, v in same_run.items() if before.get(k) != v}
        if changed:
            raise DiffspecError("--resume with other settings than the checkpoint's would train on other batches: " +
                                ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items()))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        _say(req, f"resumed from {ckpt} at step {state['step']}", world)
    amp_dtype, why = choose_train_dtype(req.train_dtype, world.device)
    _say(req, f"training matmuls in {str(amp_dtype).replace('torch.', '')} ({why})", world)
    lengths = [int(ids.shape[0]) for ids, _ in train]
    batches_per_epoch = len([b for b in epoch_batches(lengths, req.batch_sequences, req.seed, 0) if len(b) >= world.size])
    if not batches_per_epoch:
        raise DiffspecError(f"{len(train)} training sequences cannot feed {world.size} processes")
    total_steps = max(1, math.ceil(req.epochs * batches_per_epoch))
    t_loop = time.time() - state["elapsed"]
    train_budget_s = (deadline - time.time()) + state["elapsed"] if deadline else None
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    def progress() -> float:
        """Share of the budget spent (the lr schedule and the stopping rule read it); the same on every rank."""
        fr = [state["step"] / total_steps, state["step"] / req.steps if req.steps else 0.0,
              state["tokens"] / req.max_tokens if req.max_tokens else 0.0,
              (time.time() - t_loop) / max(train_budget_s, 1e-9) if train_budget_s else 0.0]
        return all_max(max(fr), world)

    def checkpoint() -> None:
        state["elapsed"] = time.time() - t_loop
        if world.main:  # written aside, then renamed: a kill mid-save leaves the previous checkpoint whole
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
                        "same_run": same_run}, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)

    from ..progress import progress_bar

    bar = progress_bar(min(total_steps, req.steps or total_steps), "train-drafter", unit="step",
                       enabled=not req.quiet and world.main, initial=state["step"])
    batches, batches_epoch = None, -1
    last_ckpt = time.time()
    model.train()
    done = progress()
    prof = StepProfile(req.profile_steps if world.main else 0, world.device, out)
    try:  # a run that fails mid-loop leaves no profiler running
        while done < 1.0:
            if batches_epoch != state["epoch"]:
                batches = [b for b in epoch_batches(lengths, req.batch_sequences, req.seed, state["epoch"]) if len(b) >= world.size]
                batches_epoch = state["epoch"]
            lr = lr_at(done, req.lr, req.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            mine = rank_share(batches[state["batch_in_epoch"]], world.rank, world.size)
            with prof.phase(0):
                batch = pad_batch([train[i] for i in mine], mine, pad).to(world.device)
                inputs = trainer.inputs(batch, state["epoch"])
            opt.zero_grad(set_to_none=True)
            with prof.phase(1), torch.autocast(torch.device(world.device).type, dtype=amp_dtype,
                                               enabled=amp_dtype != torch.float32):
                ce, weight, slots, correct, count = _parts(module(*inputs))
            with prof.phase(2):
                total_weight = all_sum(weight.float(), world).clamp(min=1e-9)
                (ce * world.size / total_weight).backward()  # DDP averages over ranks: the sum of the ranks' parts
            with prof.phase(3):
                torch.nn.utils.clip_grad_norm_(model.parameters(), req.grad_clip)
                opt.step()
            sums = all_sum(torch.stack([ce.detach().float(), slots.float(), correct.float(), count.float()]), world)
            if not torch.isfinite(sums[0]):  # every rank sees the same sum: all stop here, nothing written as done
                raise DiffspecError(f"training diverged at step {state['step'] + 1}: the loss is not finite "
                                    f"({float(sums[0])}); the last checkpoint stays as it was, no drafter is written "
                                    f"(try a lower --lr, or --train-dtype float32)")
            state["step"] += 1
            state["tokens"] += int(sums[1])
            state["anchors"] = state.get("anchors", 0) + int(sums[3])
            state["batch_in_epoch"] += 1
            if state["batch_in_epoch"] >= len(batches):
                state["epoch"], state["batch_in_epoch"] = state["epoch"] + 1, 0
            elapsed = time.time() - t_loop
            row = {"step": state["step"], "epoch": state["epoch"] + state["batch_in_epoch"] / max(1, len(batches)),
                   "loss": round(float(sums[0] / total_weight), 5), "slot1_acc": round(float(sums[2] / sums[3].clamp(min=1)), 4),
                   "lr": lr, "tokens": state["tokens"], "elapsed_s": round(elapsed, 2)}
            state["log"].append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['slot1_acc']:.2f}",
                            slots_s=f"{state['tokens'] / max(elapsed, 1e-6):.0f}", refresh=False)
            if time.time() - last_ckpt > req.checkpoint_every_s:
                checkpoint()
                last_ckpt = time.time()
            prof.step()
            done = progress()
    finally:
        prof.stop()
    bar.close()
    checkpoint()
    model.eval()
    record = None
    if world.main:
        machine["processes"] = world.size
        record = _finish(req, target, trainer, state, manifest, held, amp_dtype, why, machine, t_start, out,
                         batches_per_epoch)
    return record  # the other ranks leave at once: rank 0's health check may take minutes


def _finish(req, target, trainer, state, manifest, held, amp_dtype, why, machine, t_start, out, batches_per_epoch) -> dict:
    """Rank 0: the drafter folder, the log, the health checks, training.json."""
    from ..evaluation import evaluate_drafter, write_health

    log = state["log"]
    train_s = log[-1]["elapsed_s"] if log else 0.0
    record = {"request": asdict(req), "data": {k: manifest.get(k) for k in (
                  "target", "source", "prompts_done", "shards", "duplicates_dropped", "evaluation_overlap_dropped",
                  "generated_tokens_per_s") if k in manifest},
              "steps": state["step"], "epochs": round(state["epoch"] + state["batch_in_epoch"] / max(1, batches_per_epoch), 3),
              "supervised_tokens": state["tokens"], "train_seconds": round(train_s, 1),
              "supervised_slots_per_s": round(state["tokens"] / max(train_s, 1e-9), 1),
              "supervised_slots_per_anchor": round(state["tokens"] / max(1, state.get("anchors", 0)), 3),
              **trainer.record, "final_loss": log[-1]["loss"] if log else None,
              "train_dtype": str(amp_dtype).replace("torch.", ""), "train_dtype_choice": why, "machine": machine}
    drafter = trainer.drafter()

    def write() -> None:
        record["wall_seconds"] = round(time.time() - t_start, 1)
        save_drafter(drafter, out / "drafter", target_name=target.name, target_vocab_size=target.vocab_size,
                     training=record)
        (out / "training.json").write_text(json.dumps(record, indent=1))

    # the drafter and the log first: a health check that fails cannot lose the training
    write()
    with open(out / "train_log.jsonl", "w") as f:
        for row in log:
            f.write(json.dumps(row) + "\n")
    _save_plot(log, out / "loss.png")
    if held:
        health = evaluate_drafter(drafter, target, prompts={"held-out": [ids[:p].tolist() for ids, p in held]},
                                  num_prompts=len(held), max_new_tokens=req.eval_tokens, block_size=req.block_size,
                                  anchors_per_sequence=req.eval_anchors, cache_dir=out / "eval-cache")
        record["held_out"] = health.to_dict()
        _say(req, f"held-out tau {health.overall.tau:.3f} (p1 {health.overall.slot_acceptance[0]:.3f})")
    if req.eval_prompts:
        health = evaluate_drafter(drafter, target, num_prompts=req.eval_prompts, max_new_tokens=req.eval_tokens,
                                  block_size=req.block_size, anchors_per_sequence=req.eval_anchors,
                                  progress=not req.quiet)
        write_health(health, out / "health")
        record["health"] = health.to_dict()
        _say(req, "health check:\n" + health.table())
    write()
    _say(req, f"done: {state['step']} steps, {state['tokens']} supervised slots; drafter in {out / 'drafter'}")
    return record


def machine_info(device: str) -> dict:
    """What the run ran on (recorded with the drafter): the host, plus the GPU if used."""
    from ..devices import host_info

    info = host_info()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
