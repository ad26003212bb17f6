"""PNG plots of `diffspec bench` (matplotlib, Agg backend; skipped with a warning without it).

- speedup.png: throughput ratio vs plain per method per dataset (bars: total tokens / total time,
  over plain's on the same prompts), min-max of the per-prompt speedups (whiskers);
- accepted_length.png: per-round accepted length (emitted tokens per round, bonus included) per
  drafting method;
- raster.png: for one prompt, each drafting method's rounds: token position on x, round on y,
  accepted drafted tokens green, rejected ones red (FailFast-style raster).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO


def _pyplot(stderr: TextIO):
    try:
        import matplotlib
    except ImportError:
        print("diffspec: warning: matplotlib is not installed: skipping plots (pip install matplotlib)",
              file=stderr)
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _drafting_methods(rows: Sequence[dict]) -> list:
    """Methods with per-round statistics and at least one drafted token, in first-seen order."""
    names = dict.fromkeys(r["method"] for r in rows if r.get("round_emitted") and r.get("drafted_tokens"))
    return list(names)


def plot_speedup(plt, summary: Sequence[dict], path: Path) -> None:
    datasets = list(dict.fromkeys(s["dataset"] for s in summary))
    methods = list(dict.fromkeys(s["method"] for s in summary))
    by = {(s["dataset"], s["method"]): s for s in summary}
    width = 0.8 / max(1, len(methods))
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + len(datasets) * len(methods) * 0.35) + 2.5, 4.2))
    for j, method in enumerate(methods):
        xs, heights, lo, hi = [], [], [], []
        for i, d in enumerate(datasets):
            s = by.get((d, method))
            if s is None or s.get("throughput_ratio") is None or s["speedup_min"] is None:
                continue
            ratio = s["throughput_ratio"]
            xs.append(i - 0.4 + width * (j + 0.5))
            heights.append(ratio)
            # the ratio lies within the per-prompt range when every prompt emits as many tokens as plain;
            # a method that emits fewer or more can fall outside, and whiskers cannot be negative
            lo.append(max(0.0, ratio - s["speedup_min"]))
            hi.append(max(0.0, s["speedup_max"] - ratio))
        ax.bar(xs, heights, width, yerr=[lo, hi], capsize=3, label=method, color=colors[j % len(colors)])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("throughput vs plain (whiskers: per-prompt min-max)", fontsize=8)
    ax.set_title("diffspec bench: throughput ratio (total tokens / total time) vs plain")
    ax.legend(fontsize=7, ncol=max(1, len(methods) // 16 + 1), bbox_to_anchor=(1.01, 1.0), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grid(plt, n: int, cell=(3.2, 2.4), ncols: int = 4):
    cols = min(ncols, max(1, n))
    nrows = (max(1, n) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(cell[0] * cols, cell[1] * nrows + 0.6), squeeze=False)
    return fig, [a for row in axes for a in row]


def plot_accepted_lengths(plt, rows: Sequence[dict], path: Path) -> None:
    methods = _drafting_methods(rows)
    fig, axes = _grid(plt, len(methods))
    for ax, method in zip(axes, methods):
        lengths = [e for r in rows if r["method"] == method for e in r["round_emitted"]]
        top = max(lengths)
        ax.hist(lengths, bins=range(1, top + 2), align="left", color="tab:blue", rwidth=0.85)
        ax.set_xlim(0.4, top + 0.6)
        ax.set_xticks(range(1, top + 1, max(1, top // 10)))
        ax.set_title(f"{method}\nmean {sum(lengths) / len(lengths):.2f}", fontsize=8)
        ax.set_xlabel("accepted length (tokens per round)", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in axes[len(methods):]:
        ax.axis("off")
    if not methods:
        axes[0].text(0.5, 0.5, "no method drafted any token", ha="center", va="center")
    fig.suptitle("accepted length per round", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_raster(plt, rows: Sequence[dict], prompt_id: str, path: Path) -> None:
    chosen = [r for r in rows if r["prompt_id"] == prompt_id]
    methods = [m for m in _drafting_methods(chosen)]
    n = max(1, len(methods))
    fig, axes = plt.subplots(n, 1, figsize=(9, 1.0 + 1.6 * n), squeeze=False, sharex=True)
    axes = [a for row in axes for a in row]
    for ax, method in zip(axes, methods):
        r = next(x for x in chosen if x["method"] == method)
        start = 0
        for i, (drafted, accepted, emitted) in enumerate(zip(r["round_drafted"], r["round_accepted"],
                                                             r["round_emitted"])):
            if accepted:
                ax.barh(i, accepted, left=start, height=0.9, color="tab:green", linewidth=0)
            if drafted > accepted:
                ax.barh(i, drafted - accepted, left=start + accepted, height=0.9, color="tab:red", linewidth=0)
            start += emitted
        ax.set_ylim(len(r["round_emitted"]) - 0.5, -0.5)
        ax.set_ylabel("round", fontsize=7)
        ax.set_title(f"{method}: mean accepted length {r['mean_accepted_length']:.2f}", fontsize=8)
        ax.tick_params(labelsize=7)
    if not methods:
        axes[0].text(0.5, 0.5, "no method drafted any token on this prompt", ha="center", va="center")
    axes[-1].set_xlabel("token position (green: accepted drafted tokens, red: rejected)", fontsize=8)
    fig.suptitle(f"acceptance raster, prompt {prompt_id}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(rows: Sequence[dict], summary: Sequence[dict], out: Path, raster_prompt: Optional[str] = None,
               stderr: Optional[TextIO] = None) -> list:
    """Write the PNGs into `out`; return their paths ([] without matplotlib or rows)."""
    stderr = sys.stderr if stderr is None else stderr
    plt = _pyplot(stderr) if rows else None
    if plt is None:
        return []
    out = Path(out)
    paths = [out / "speedup.png", out / "accepted_length.png", out / "raster.png"]
    plot_speedup(plt, summary, paths[0])
    plot_accepted_lengths(plt, rows, paths[1])
    plot_raster(plt, rows, raster_prompt if raster_prompt is not None else rows[0]["prompt_id"], paths[2])
    return paths
