"""Time one drafting step of the same trained drafter three ways, in float32 and bfloat16, on the
real target (SmolLM2-135M-Instruct): diffspec with the DFlash export (full vocabulary), the
reference package with that export, and diffspec with the shipped folder (reduced draft
vocabulary of 8,192 tokens, the same trained weights). This isolates what the drafter dtype and
the vocabulary change in a round; the bench rows give the rest.

Rows: the drafter body in float32 / bfloat16 with the target's float32 LM head (what loading in a
dtype gives, and what the reference does), and diffspec with `--drafter-dtype` set to that dtype,
which also computes the LM head in it (a copy; the target keeps its own).

One step = the drafter's keys/values for 2 newly accepted positions, its pass over
[anchor, mask x 7], and the draft logits (diffspec also takes the softmax its policies read).

    python benchmarks/results/issue7_dflash_ref/draft_step.py EXPORTED_DIR [--threads 2] [--reps 100]
"""

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from diffspec import Target
from diffspec.checkpoint import load_drafter, shipped_drafter_path
from diffspec.dflash_format import reference

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def median_ms(step, reps: int) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def diffspec_step(drafter, target, ids, feats):
    ctx, n = torch.tensor(ids), len(ids)
    drafter.attach(target)
    drafter.begin(None)
    drafter.observe(feats[: n - 3], 0)

    def step():
        drafter._flush()
        drafter._cache.length = min(drafter._cache.length, n - 3)  # back to the cached context (position-indexed
        drafter._context_len = n - 3                               # cache since 3b1549b; a list of tensors before)
        drafter.observe(feats[n - 3: n - 1], n - 3)
        torch.softmax(drafter.block_logits(ctx).float(), -1).max(-1)

    return step


def reference_step(ref, target, ids, feats, dtype):
    ctx, n, b = torch.tensor(ids), len(ids), ref.block_size
    embed, head = target.model.get_input_embeddings(), target.model.lm_head
    cache = DynamicCache(config=ref.config)
    with torch.inference_mode():  # the cached context, as dflash_generate leaves it after a round
        ref(target_hidden=feats[None, : n - 3].to(dtype), noise_embedding=embed(ctx[None, :1]).to(dtype),
            position_ids=torch.arange(n - 2)[None], past_key_values=cache, use_cache=True)
        cache.crop(-1)
    block = torch.full((1, b), ref.mask_token_id)
    block[0, 0] = ctx[-1]

    @torch.inference_mode()
    def step():
        h = ref(target_hidden=feats[None, n - 3: n - 1].to(dtype), noise_embedding=embed(block).to(dtype),
                position_ids=torch.arange(n - 3, n - 1 + b)[None], past_key_values=cache, use_cache=True)
        cache.crop(-(b + 2))
        ref.compute_logits(h[:, 1:].to(head.weight.dtype), head).argmax(-1)

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("exported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(None, quiet=True)
    ids = target.encode_prompt(PROMPT)
    model_class, _ = reference()
    for dtype in (torch.float32, torch.bfloat16):
        full = load_drafter(args.exported, dtype=dtype)
        feats = Target(target.model).forward(torch.tensor(ids), hidden_layers=full.target_layer_ids).hidden_states
        ref = model_class.from_pretrained(args.exported, dtype=dtype).eval()
        reduced = load_drafter(shipped_drafter_path(target.name, "conditioned"), dtype=dtype)
        head_too = load_drafter(args.exported, dtype=torch.float32)
        head_too.compute_dtype = str(dtype).replace("torch.", "")  # --drafter-dtype: body and a head copy
        row = {"dtype": str(dtype).replace("torch.", ""), "context_tokens": len(ids),
               "diffspec_full_vocab_ms": median_ms(diffspec_step(full, target, ids, feats), args.reps),
               "diffspec_full_vocab_head_in_dtype_ms": median_ms(diffspec_step(head_too, target, ids, feats), args.reps),
               "reference_full_vocab_ms": median_ms(reference_step(ref, target, ids, feats, dtype), args.reps),
               "diffspec_reduced_vocab_8192_ms": median_ms(diffspec_step(reduced, target, ids, feats), args.reps)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
