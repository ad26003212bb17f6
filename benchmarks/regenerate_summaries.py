"""Rewrite summary.json, summary.md and speedup.png of recorded `diffspec bench` folders from their
results.jsonl with the current report code, without running anything again.

    python benchmarks/regenerate_summaries.py                       # every bench folder under benchmarks/results
    python benchmarks/regenerate_summaries.py benchmarks/results/issue5_all_methods [--no-plot]

A bench folder is one with results.jsonl and a summary.json written by `diffspec bench` (it holds
the command, machine, settings and methods, which results.jsonl does not); other folders (e.g.
benchmarks/serve_load.py's) are skipped and named. results.jsonl, accepted_length.png and
raster.png are left as they are (they do not depend on the summary), speedup.png is redrawn
only where it exists; every other key of
summary.json is kept, and summary, best and round_profile are recomputed.

The older records written by the retired benchmarks/speed_check.py (a NAME.json with `rows` and a
NAME.md beside it, directly under benchmarks/results) get the same per set x config figures: a
`summary` key in NAME.json and a "Per set and config" section at the end of NAME.md (replaced
when present). Their baseline config is `none`; the set is the prompt id's prefix before ':'
(`all` for prompts without one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffspec.bench.report import best_per_dataset, markdown, round_profile, summarize
from diffspec.bench.run import BenchResult

RESULTS = Path(__file__).resolve().parent / "results"
BENCH_KEYS = {"command", "machine", "settings", "methods", "summary"}
LEGACY_SECTION = "## Per set and config"


def bench_folders(root: Path) -> tuple:
    """(bench folders, skipped folders with a results.jsonl that `diffspec bench` did not write)."""
    found, skipped = [], []
    for results in sorted(root.rglob("results.jsonl")):
        folder = results.parent
        record = folder / "summary.json"
        ok = record.is_file() and BENCH_KEYS <= set(json.loads(record.read_text()))
        (found if ok else skipped).append(folder)
    return found, skipped


def regenerate(folder: Path, plot: bool = True) -> dict:
    """Recompute the summary of one bench folder and rewrite its files; return the new record."""
    rows = tuple(json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip())
    record = json.loads((folder / "summary.json").read_text())
    result = BenchResult(rows, tuple(record["methods"]), tuple(record.get("lossless_failures", ())),
                         record["machine"], record["settings"])
    summary = summarize(rows)
    best = best_per_dataset(summary)
    record.update(summary=summary, best=best, round_profile=round_profile(rows))
    plots = list(record.get("plots", []))
    if plot and "speedup.png" in plots and (folder / "speedup.png").is_file():  # redraw, never add one
        from diffspec.bench.plots import _pyplot, plot_speedup

        plt = _pyplot(sys.stderr)
        if plt is not None:
            plot_speedup(plt, summary, folder / "speedup.png")
    (folder / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / "summary.md").write_text(markdown(result, summary, best, plots))
    return record


def legacy_files(root: Path) -> list:
    """speed_check.py records: NAME.json with `rows` (each with `config`) and NAME.md beside it."""
    found = []
    for path in sorted(root.glob("*.json")):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and record.get("rows") and "config" in record["rows"][0] \
                and path.with_suffix(".md").is_file():
            found.append(path)
    return found


def regenerate_legacy(path: Path) -> list:
    """Per set x config summary of a speed_check.py record, written into its .json and .md."""
    record = json.loads(path.read_text())
    rename = {"none": "plain"}  # summarize's baseline is called plain; speed_check.py called it none
    rows = []
    for r in record["rows"]:
        dataset = r["prompt_id"].split(":", 1)[0] if ":" in r["prompt_id"] else "all"
        rows.append(dict(r, dataset=dataset, method=rename.get(r["config"], r["config"]),
                         lossless=r.get("identical_to_none")))
    summary = [dict(e, method="none" if e["method"] == "plain" else e["method"]) for e in summarize(rows)]
    record["summary"] = [{k: e[k] for k in ("dataset", "method", "prompts", "throughput_ratio", "speedup_mean",
                                            "speedup_median", "speedup_min", "speedup_max", "mean_accepted_length",
                                            "tokens_per_s", "lossless")} for e in summary]
    path.write_text(json.dumps(record, indent=1))  # as speed_check.py wrote it: no final newline
    fmt = lambda v, suffix="": "-" if v is None else f"{v:.2f}{suffix}"  # noqa: E731
    lines = [LEGACY_SECTION, "",
             "Computed from the rows above (no re-run) by `benchmarks/regenerate_summaries.py`. Throughput ratio = "
             "the config's total new tokens / total wall time, over `none`'s on the same prompts; per-prompt "
             "speedup = `none`'s wall time / the config's on one prompt (mean, median, min-max over prompts).", "",
             "| set | config | prompts | throughput ratio | per-prompt speedup mean | median | min-max | "
             "mean acc. len | tok/s (sum tokens / sum time) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        lines.append(f"| {e['dataset']} | {e['method']} | {e['prompts']} | {fmt(e['throughput_ratio'], 'x')} | "
                     f"{fmt(e['speedup_mean'], 'x')} | {fmt(e['speedup_median'], 'x')} | "
                     f"{fmt(e['speedup_min'])}-{fmt(e['speedup_max'])} | {fmt(e['mean_accepted_length'])} | "
                     f"{fmt(e['tokens_per_s'])} |")
    md_path = path.with_suffix(".md")
    md = md_path.read_text()
    if LEGACY_SECTION in md:
        md = md[:md.index(LEGACY_SECTION)]
    md_path.write_text(md.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n")
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, help=f"bench folders (default: all under {RESULTS})")
    parser.add_argument("--no-plot", action="store_true", help="leave speedup.png as it is")
    args = parser.parse_args(argv)
    if args.folders:
        folders, skipped = args.folders, []
    else:
        folders, skipped = bench_folders(RESULTS)
    for folder in folders:
        record = regenerate(folder, plot=not args.no_plot)
        print(f"{folder}: {len(record['summary'])} entries, best {record['best']}")
    for folder in skipped:
        print(f"{folder}: skipped (results.jsonl not written by diffspec bench)")
    if not args.folders:
        for path in legacy_files(RESULTS):
            print(f"{path}: {len(regenerate_legacy(path))} entries (speed_check.py record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
