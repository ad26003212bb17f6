"""Does the shipped conditioned drafter (trained at block 8) keep its slot-1 acceptance when its pass runs a
shorter block (fewer trailing mask rows: a cheaper pass for a short draft)? eval-drafter on HumanEval, 10 prompts,
128 tokens, every position, the same weights at blocks 8, 4 and 2.

    python benchmarks/results/issue16_training/block_truncation/truncated_block.py 10
"""
import dataclasses, json, sys, time, torch
from diffspec.api import load_engine
from diffspec.drafters.conditioned import ConditionedDrafter
from diffspec.evaluation import evaluate_drafter
eng = load_engine(drafter="conditioned", policy="fixed", backend="transformers", kernels="auto", quiet=True)
base = eng.drafter
target = eng.target
res = {}
for B in (8, 4, 2):
    model = base.model
    d = ConditionedDrafter(model, base.tokenizer_fingerprint, name=f"block{B}")
    d.cfg = dataclasses.replace(model.cfg, block_size=B)
    d.default_gamma = d.max_tokens_per_round = B - 1
    t = time.perf_counter()
    h = evaluate_drafter(d, target, sets=("humaneval",), num_prompts=int(sys.argv[1]), max_new_tokens=128, block_size=B)
    dom = h.to_json() if hasattr(h, "to_json") else h
    print(B, round(time.perf_counter() - t, 1), json.dumps(dom, default=str)[:600])
