"""Copy a trained drafter folder into the package as a target's shipped drafter, with its record.

    python scripts/ship_drafter.py OUT_DIR [--target smollm2-135m-instruct] [--kind conditioned]

OUT_DIR is a `diffspec train-drafter --out` folder (drafter/, training.json, loss.png). Writes
src/diffspec/weights/<target>/<kind>/{config.json, model.safetensors, TRAINING.md, loss.png};
refuses weights over 25 MB (shared target weights are never stored).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

LIMIT = 25 * 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--kind", default="conditioned")
    ap.add_argument("--notes", default="", help="extra provenance text for TRAINING.md")
    args = ap.parse_args()
    src = Path(args.out_dir)
    weights = src / "drafter" / "model.safetensors"
    if weights.stat().st_size > LIMIT:
        print(f"{weights} is {weights.stat().st_size / 2 ** 20:.1f} MB, over the 25 MB limit", file=sys.stderr)
        return 1
    dst = Path(__file__).resolve().parent.parent / "src" / "diffspec" / "weights" / args.target / args.kind
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / "drafter" / name, dst / name)
    if (src / "loss.png").is_file():
        shutil.copy2(src / "loss.png", dst / "loss.png")
    rec = json.loads((src / "training.json").read_text())
    req, data = rec["request"], rec["data"]
    health = rec.get("health") or {}
    taus = ", ".join(f"{d} {v['tau']:.2f}" for d, v in health.get("domains", {}).items())
    lines = [f"# Shipped {args.kind} drafter for {args.target}", "",
             f"- weights: fp16 safetensors, {weights.stat().st_size / 2 ** 20:.1f} MB (the target's embeddings and "
             "LM head are shared, not stored)",
             f"- architecture: {rec.get('layers') or req['layers']} layer(s), block {req['block_size']}, draft vocabulary "
             f"{rec.get('draft_vocab')} tokens ({100 * rec.get('draft_vocab_coverage', 1):.1f}% of the target's choices)",
             f"- data: token store of {data.get('prompts_done')} "
             + ("corpus conversations as written (labels computed over them by the target)"
                if data.get("source") == "corpus" else "prompts answered by the target itself") + " "
             f"({rec.get('train_sequences')} training sequences, {rec.get('train_response_tokens')} response tokens; "
             f"{data.get('duplicates_dropped')} repeated answers dropped, {data.get('evaluation_overlap_dropped')} "
             "conversations dropped for overlapping HumanEval/MT-Bench/CHAMP); labels = "
             + ("the target's own top-32 distributions (self-distillation)" if req.get("objective") == "distill"
                else "the data tokens" if req.get("objective") == "corpus" else "the target's own greedy choices"),
             f"- training: {rec['steps']} steps ({rec.get('epochs')} epochs), {rec['supervised_tokens']} supervised "
             f"draft slots, {rec['train_seconds']} s of steps, {rec.get('supervised_slots_per_s')} slots/s "
             f"({rec.get('train_dtype', 'float32')} matmuls: {rec.get('train_dtype_choice', '')})",
             f"- health check (eval-drafter, greedy, block {req['block_size']}, bonus counted): tau {taus or 'n/a'}; "
             f"held-out store sequences tau {(rec.get('held_out') or {}).get('overall', {}).get('tau')}",
             *([f"- started from the drafter in {rec['init_drafter']} (--init-drafter)"] if rec.get("init_drafter") else []),
             f"- machine: {json.dumps(rec.get('machine', {}))}", "",
             "Request (`diffspec train-drafter` options):", "", "```json", json.dumps(req, indent=1), "```", ""]
    if args.notes:
        lines += ["Provenance:", "", args.notes, ""]
    (dst / "TRAINING.md").write_text("\n".join(lines))
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
