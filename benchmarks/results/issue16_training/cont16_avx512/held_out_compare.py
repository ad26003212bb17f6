"""The shipped drafter and the continued one on the store's held-out prompts (the same 42 prompts,
continuations and anchors as the end-of-run check of cont16), block 16.

    python benchmarks/results/issue16_training/cont16_avx512/held_out_compare.py /work/runs/store /work/runs/cont16
"""
import json
import sys
from dataclasses import asdict
from pathlib import Path

from diffspec.checkpoint import load_drafter, shipped_drafter_path
from diffspec.evaluation import evaluate_drafter
from diffspec.target import Target
from diffspec.training.distributed import World
from diffspec.training.run import TrainRequest, load_training_data

store, run = Path(sys.argv[1]), Path(sys.argv[2])
req = TrainRequest(**{k: v for k, v in json.loads((run / "training.json").read_text())["request"].items()
                      if k in TrainRequest.__dataclass_fields__})
target = Target.load(req.target or "smollm2-135m-instruct")
_, held, _ = load_training_data(req, target, World(), None)
prompts = {"held-out": [ids[:p].tolist() for ids, p in held]}
out = {}
for name, path in (("shipped", shipped_drafter_path("smollm2-135m-instruct", "conditioned")), ("cont16", run / "drafter")):
    h = evaluate_drafter(load_drafter(path), target, prompts=prompts, num_prompts=len(held), max_new_tokens=req.eval_tokens,
                         block_size=16, anchors_per_sequence=req.eval_anchors, cache_dir=run / "eval-cache")
    d = next(x for x in h.domains if x.domain == "held-out") if isinstance(h.domains, tuple) else h.domains["held-out"]
    out[name] = {"tau": d.tau, "slot_acceptance": d.slot_acceptance[:4], "anchors": d.anchors}
    print(name, json.dumps(out[name]))
(Path(__file__).parent / "held_out_compare.json").write_text(json.dumps(out, indent=1))
