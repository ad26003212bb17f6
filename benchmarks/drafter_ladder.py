"""The scaling ladder: the same recipe on nested shares of one token store, so the slope says what
more data would buy.

    python benchmarks/drafter_ladder.py --data STORE --out DIR [--fractions 0.125 0.25 0.5 1] \
        [--reuse] -- [train-drafter options, e.g. --epochs 2 --layers 2 --block-size 16]

Each rung is `diffspec train-drafter --data STORE --data-fraction F --out DIR/fF ...` (every rung keeps
the same held-out sequences; a smaller share is a subset of a larger one), then its health check (the
three evaluation sets, per domain) and held-out check are read from DIR/fF/training.json. Writes
DIR/ladder.json, DIR/ladder.md and DIR/ladder.png (tau per domain against supervised response tokens).
`--reuse` skips rungs whose training.json exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def rung(data: str, out: Path, fraction: float, extra: list, reuse: bool) -> dict:
    folder = out / f"f{fraction:g}"
    if not (reuse and (folder / "training.json").is_file()):
        cmd = [sys.executable, "-m", "diffspec", "train-drafter", "--data", data, "--out", str(folder),
               "--data-fraction", str(fraction), *extra]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        t0 = time.time()
        subprocess.run(cmd, check=True)
        print(f"rung {fraction:g}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rec = json.loads((folder / "training.json").read_text())
    health, held = rec.get("health") or {}, rec.get("held_out") or {}
    return {"fraction": fraction, "steps": rec["steps"], "epochs": rec["epochs"],
            "supervised_slots": rec["supervised_tokens"], "train_sequences": rec.get("train_sequences"),
            "train_response_tokens": rec.get("train_response_tokens"), "train_seconds": rec["train_seconds"],
            "supervised_slots_per_s": rec["supervised_slots_per_s"], "final_loss": rec["final_loss"],
            "tau": {d: v["tau"] for d, v in health.get("domains", {}).items()},
            "tau_overall": health.get("overall", {}).get("tau"),
            "slot_acceptance_overall": health.get("overall", {}).get("slot_acceptance"),
            "held_out_tau": held.get("overall", {}).get("tau"), "folder": str(folder)}


def write(out: Path, rows: list, argv: list) -> None:
    (out / "ladder.json").write_text(json.dumps({"command": " ".join(argv), "rungs": rows}, indent=1))
    domains = sorted({d for r in rows for d in r["tau"]})
    head = "| share | train sequences | response tokens | epochs | supervised slots | train s | final loss | " + \
           " | ".join(f"tau {d}" for d in domains) + " | tau all | held-out tau |"
    lines = ["# Scaling ladder", "", f"`{' '.join(argv)}`", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['fraction']:g} | {r['train_sequences']} | {r['train_response_tokens']} | {r['epochs']} | "
                     f"{r['supervised_slots']} | {r['train_seconds']} | {r['final_loss']} | " +
                     " | ".join(f"{r['tau'].get(d, float('nan')):.3f}" for d in domains) +
                     f" | {r['tau_overall'] or float('nan'):.3f} | {r['held_out_tau'] or float('nan'):.3f} |")
    (out / "ladder.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [r["train_response_tokens"] or r["fraction"] for r in rows]
    for d in domains:
        ax.plot(x, [r["tau"].get(d) for r in rows], marker="o", label=d)
    ax.plot(x, [r["held_out_tau"] for r in rows], marker="s", ls="--", label="held-out (store)")
    ax.set_xscale("log")
    ax.set_xlabel("training response tokens")
    ax.set_ylabel("tau (accepted per round, bonus counted)")
    ax.set_title("scaling ladder")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ladder.png", dpi=100)
    plt.close(fig)


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for f in sorted(args.fractions):
        rows.append(rung(args.data, out, f, extra, args.reuse))
        write(out, rows, ["python", "benchmarks/drafter_ladder.py"] + argv)
    print((out / "ladder.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
