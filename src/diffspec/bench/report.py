"""Summaries and output files of `diffspec bench`.

`summarize(rows)` groups rows per dataset x method (plus an `all` group per method when there
are several datasets). The headline figure of a group is its throughput ratio: the method's total
new tokens / total wall time over plain's on the same prompts; beside it the mean / median / min /
max of the per-prompt speedups, and the other means. `best_per_dataset` picks the highest
throughput ratio among configurations not shown lossy. `write_outputs` writes results.jsonl (one
row per method x prompt), summary.json, summary.md and the PNG plots.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

from ..errors import DiffspecError
from ..types import format_histogram

ALL = "all"
BASELINE = "plain"


def _groups(rows: Sequence[dict]) -> list:
    """[((dataset, method), rows)] in first-seen order, plus ('all', method) when datasets > 1."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["method"]), []).append(r)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    if len(datasets) > 1:
        for r in rows:
            groups.setdefault((ALL, r["method"]), []).append(r)
    return list(groups.items())


def _lossless(rows: Sequence[dict]) -> Optional[bool]:
    flags = [r.get("lossless") for r in rows]
    if any(f is False for f in flags):
        return False
    if flags and all(f is True for f in flags):
        return True
    return None


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def histogram_from_round_drafted(round_drafted: Sequence[int]) -> dict:
    """Tokens verified per round -> {"k": rounds that verified k drafted tokens}, sorted by k (string
    keys, as JSON writes them and as `GenerationResult.stats_dict` gives them)."""
    counts: dict = {}
    for k in round_drafted:
        counts[int(k)] = counts.get(int(k), 0) + 1
    return {str(k): n for k, n in sorted(counts.items())}


def _row_histogram(row: dict) -> dict:
    """A row's histogram; rows written before it was recorded have their round_drafted list."""
    hist = row.get("draft_length_histogram")
    return hist if hist is not None else histogram_from_round_drafted(row.get("round_drafted") or ())


def sum_histograms(hists) -> dict:
    """{"k": rounds} summed over several histograms, sorted by k."""
    total: dict = {}
    for hist in hists:
        for k, n in hist.items():
            total[int(k)] = total.get(int(k), 0) + n
    return {str(k): n for k, n in sorted(total.items())}


def throughput_ratio(rs: Sequence[dict], baseline: dict) -> Optional[float]:
    """(total new tokens / total wall time of `rs`) / (the same of plain's rows for the same prompts).

    `baseline` maps (dataset, prompt_id) to plain's row. Only prompts that plain also ran, with
    positive wall times on both sides, count; the wall times are the per-prompt medians over repeats
    that the per-prompt speedups divide, so the two figures describe the same measurements. Unlike
    the mean of per-prompt ratios it weighs each prompt by its time: a long slow prompt counts more
    than a short fast one. None when no prompt pairs with plain."""
    pairs = [(r, baseline.get((r["dataset"], r["prompt_id"]))) for r in rs]
    pairs = [(r, b) for r, b in pairs if b is not None and r["wall_time_s"] > 0 and b["wall_time_s"] > 0]
    if not pairs:
        return None
    mine = sum(r["new_tokens"] for r, _ in pairs) / sum(r["wall_time_s"] for r, _ in pairs)
    base = sum(b["new_tokens"] for _, b in pairs) / sum(b["wall_time_s"] for _, b in pairs)
    return round(mine / base, 4) if base > 0 else None


def summarize(rows: Sequence[dict]) -> list:
    """One dict per dataset x method: throughput_ratio (the headline, see `throughput_ratio`; None
    without plain rows for those prompts), speedup mean/median/min/max over the per-prompt speedups
    (plain's time / the method's on each prompt), and other means.

    tokens_per_s is aggregate (total new tokens / total wall time); lossless is True when every
    prompt matched plain, False when any differed, None when not checked (sampling).

    rounds: total draft-verify rounds (None when the method does not count them, e.g. HF methods);
    speculation_off_rounds: rounds the policy ran no drafter in, and speculation_off_share that over
    rounds (None without rounds); hidden_state_rounds: rounds whose verify pass returned hidden states for
    the drafter; draft_length_histogram: {"k": rounds that verified k drafted
    tokens} summed over the prompts."""
    baseline = {(r["dataset"], r["prompt_id"]): r for r in rows if r["method"] == BASELINE}
    out = []
    for (dataset, method), rs in _groups(rows):
        speedups = [r["speedup"] for r in rs if r.get("speedup") is not None]
        wall = sum(r["wall_time_s"] for r in rs)
        tokens = sum(r["new_tokens"] for r in rs)
        rounds = sum(r.get("rounds") or 0 for r in rs)
        off = sum(r.get("speculation_off_rounds") or 0 for r in rs)
        out.append({
            "dataset": dataset, "method": method, "prompts": len(rs),
            "throughput_ratio": throughput_ratio(rs, baseline),
            "speedup_mean": _mean(speedups),
            "speedup_median": round(statistics.median(speedups), 4) if speedups else None,
            "speedup_min": round(min(speedups), 4) if speedups else None,
            "speedup_max": round(max(speedups), 4) if speedups else None,
            "mean_accepted_length": _mean(r["mean_accepted_length"] for r in rs),
            "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
            "wall_time_s_mean": _mean(r["wall_time_s"] for r in rs),
            "new_tokens_mean": _mean(r["new_tokens"] for r in rs),
            "target_forward_passes_mean": _mean(r["target_forward_passes"] for r in rs),
            "drafter_forward_passes_mean": _mean(r["drafter_forward_passes"] for r in rs),
            "draft_time_s_mean": _mean(r.get("draft_time_s") for r in rs),
            "verify_time_s_mean": _mean(r.get("verify_time_s") for r in rs),
            "rounds": rounds or None,
            "speculation_off_rounds": off,
            "speculation_off_share": round(off / rounds, 4) if rounds else None,
            "hidden_state_rounds": sum(r.get("hidden_state_rounds") or 0 for r in rs),
            "draft_length_histogram": sum_histograms(_row_histogram(r) for r in rs),
            "lossless": _lossless(rs),
            "identical_prompts": sum(r.get("lossless") is True for r in rs),
            "compared_prompts": sum(r.get("lossless") is not None for r in rs),
            "weights": rs[0].get("weights"), "policy": rs[0].get("policy"),
        })
    return out


def round_profile(rows: Sequence[dict]) -> list:
    """Where a round's time goes, per method over all prompts (engine methods only): ms per round
    of drafting, of the verify pass (+ acceptance and cache rollback), of prefill spread over the
    rounds, and the rest (sampling bookkeeping, stop checks, detokenising, drafter feedback); and ms per
    drafter pass: the drafting time of the rounds that ran a pass over the passes (a row without that
    time, from a runner that cannot tell, counts all its drafting time)."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method and r.get("rounds") and r.get("draft_time_s") is not None]
        if not rs:
            continue
        rounds = sum(r["rounds"] for r in rs)
        wall = sum(r["wall_time_s"] for r in rs)
        draft = sum(r["draft_time_s"] for r in rs)
        verify = sum(r["verify_time_s"] for r in rs)
        prefill = sum(r.get("prefill_time_s") or 0.0 for r in rs)
        pass_draft = sum(r["draft_time_s"] if r.get("pass_round_draft_time_s") is None else r["pass_round_draft_time_s"]
                         for r in rs)
        has_prefill = all(r.get("prefill_time_s") is not None for r in rs)
        ms = lambda x: round(1000 * x / rounds, 2)  # noqa: E731
        out.append({"method": method, "rounds": rounds, "tokens_per_round": round(sum(r["new_tokens"] for r in rs) / rounds, 3),
                    "ms_per_round": ms(wall), "draft_ms": ms(draft), "verify_ms": ms(verify),
                    "prefill_ms": ms(prefill) if has_prefill else None,
                    "other_ms": ms(wall - draft - verify - prefill),
                    "ms_per_drafter_pass": round(1000 * pass_draft / max(1, sum(r["drafter_forward_passes"] for r in rs)), 2)
                    if any(r["drafter_forward_passes"] for r in rs) else None})
    return out


def _headline(entry: dict) -> Optional[float]:
    """The throughput ratio; the median per-prompt speedup only for entries without one (no plain rows)."""
    ratio = entry.get("throughput_ratio")
    return entry.get("speedup_median") if ratio is None else ratio


def best_per_dataset(summary: Sequence[dict]) -> dict:
    """{dataset: method} with the highest throughput ratio among entries whose lossless is not False
    (the median per-prompt speedup stands in where an entry has no throughput ratio); ties keep the
    first entry."""
    best: dict = {}
    for s in summary:
        if s["lossless"] is False or _headline(s) is None:
            continue
        current = best.get(s["dataset"])
        if current is None or _headline(s) > _headline(current):
            best[s["dataset"]] = s
    return {d: s["method"] for d, s in best.items()}


def _fmt(value, suffix: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _yes_no(flag: Optional[bool]) -> str:
    return {True: "yes", False: "**NO**", None: "n/a"}[flag]


def _lossless_cell(entry: dict) -> str:
    """yes / n/a, or **NO** with the share of prompts still identical to plain (a bfloat16 target's parity rate)."""
    if entry["lossless"] is False and entry.get("compared_prompts"):
        return f"**NO** ({entry['identical_prompts']}/{entry['compared_prompts']} identical)"
    return _yes_no(entry["lossless"])


def markdown(result, summary: Sequence[dict], best: dict, plots: Sequence[str]) -> str:
    """summary.md: command, machine, settings, the table (best marked), methods, failures, plots."""
    m, s = result.machine, result.settings
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    lines = ["# diffspec bench", "", "Command:", "", f"    {s['command']}", "",
             f"Machine: {m['cpu']} ({m['cpus']} CPUs; {flags}); torch threads {m['threads']}; "
             f"torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; commit {m['commit']}.", "",
             f"Target {s['target']} ({s['target_dtype']}); {s['prompts']} prompts from `{s['dataset']}`; "
             f"{s['max_new_tokens']} new tokens max; temperature {s['temperature']}"
             + (f", seed {s['seed']}" if s["seed"] is not None else "")
             + f"; median of {s['repeats']} repeat(s); methods interleaved per prompt after a warm-up.", "",
             "Throughput ratio (the headline) = the method's total new tokens / total wall time, over plain's "
             "on the same prompts; per-prompt speedup = plain's wall time / the method's on one prompt "
             "(mean, median, min-max over prompts; the mean weighs a short prompt like a long one); "
             "tok/s = total new tokens / total time; "
             "lossless = token-identical to plain on every prompt (n/a when sampling, and for a peer running "
             "its own loop, e.g. llama.cpp's: compared, not judged; where it is not, how many prompts stayed "
             "identical: a bfloat16 target's parity rate); "
             "best = highest throughput ratio among configurations not shown lossy.", "",
             "| dataset | method | prompts | throughput ratio | per-prompt speedup mean | median | min-max | "
             "mean acc. len | tok/s | target passes | drafter passes | lossless | best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        spread = "-" if e["speedup_min"] is None else f"{e['speedup_min']:.2f}-{e['speedup_max']:.2f}"
        mark = "**best**" if best.get(e["dataset"]) == e["method"] else ""
        lines.append(f"| {e['dataset']} | {e['method']} | {e['prompts']} | {_fmt(e.get('throughput_ratio'), 'x')} | "
                     f"{_fmt(e['speedup_mean'], 'x')} | "
                     f"{_fmt(e['speedup_median'], 'x')} | {spread} | {_fmt(e['mean_accepted_length'])} | "
                     f"{_fmt(e['tokens_per_s'], '', 1)} | {_fmt(e['target_forward_passes_mean'], '', 1)} | "
                     f"{_fmt(e['drafter_forward_passes_mean'], '', 1)} | {_lossless_cell(e)} | {mark} |")
    profile = round_profile(result.rows)
    if profile:
        lines += ["", "## Where a round's time goes (all prompts)", "",
                  "Per draft-verify round, in ms: drafting; the verify pass with acceptance and cache rollback; "
                  "prefill spread over the rounds (- when not recorded: then it is inside 'other'); the rest "
                  "(bookkeeping, stop checks, detokenising, drafter feedback); ms / drafter pass = the drafting "
                  "time of the rounds that ran a drafter pass, over the passes (a pass-free part's time in other "
                  "rounds, e.g. prompt lookup's, left out).", "",
                  "| method | rounds | tokens / round | ms / round | draft | verify | prefill | other | ms / drafter pass |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in profile:
            lines.append(f"| {p['method']} | {p['rounds']} | {p['tokens_per_round']:.2f} | {p['ms_per_round']:.1f} | "
                         f"{p['draft_ms']:.1f} | {p['verify_ms']:.1f} | {_fmt(p['prefill_ms'], '', 1)} | "
                         f"{p['other_ms']:.1f} | {_fmt(p['ms_per_drafter_pass'], '', 1)} |")
    counted = [e for e in summary if e.get("rounds")]
    if counted:
        lines += ["", "## Draft lengths", "",
                  "Per draft-verify round: speculation off = rounds the policy ran no drafter in (a plain step "
                  "by choice), and their share of the rounds; k histogram = rounds that verified k drafted "
                  "tokens (kK:rounds; k0 counts the speculation-off rounds and the rounds with no draft).", "",
                  "| dataset | method | rounds | speculation off | share off | k histogram |",
                  "|---|---|---|---|---|---|"]
        for e in counted:
            lines.append(f"| {e['dataset']} | {e['method']} | {e['rounds']} | {e['speculation_off_rounds']} | "
                         f"{_fmt(100 * e['speculation_off_share'], '%', 1)} | "
                         f"{format_histogram(e['draft_length_histogram'])} |")
    lines += ["", "## Methods", "", "| method | backend | weights | policy | notes |", "|---|---|---|---|---|"]
    for meth in result.methods:
        notes = "; ".join(meth["notes"]).replace("|", "/") or ""
        lines.append(f"| {meth['name']} | {meth.get('backend', 'transformers')} | {meth['weights']} | {meth['policy']} | "
                     f"{notes} |")
    if result.failures:
        lines += ["", "## LOSSLESS FAILURES", ""] + [f"- {f}" for f in result.failures]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_outputs(result, out, raster_prompt: Optional[str] = None, stderr: Optional[TextIO] = None) -> tuple:
    """Write results.jsonl, summary.json, summary.md and the plots into `out`; return the paths."""
    from .plots import make_plots

    stderr = sys.stderr if stderr is None else stderr
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiffspecError(f"cannot create output folder {out}: {e.strerror}") from None
    summary = summarize(result.rows)
    best = best_per_dataset(summary)
    plots = make_plots(result.rows, summary, out, raster_prompt, stderr=stderr)
    files = [out / "results.jsonl", out / "summary.json", out / "summary.md"]
    with open(files[0], "w") as f:
        for row in result.rows:
            f.write(json.dumps(row) + "\n")
    record = {"command": result.settings["command"], "machine": result.machine, "settings": result.settings,
              "methods": list(result.methods), "summary": summary, "best": best,
              "round_profile": round_profile(result.rows),
              "lossless_failures": list(result.failures), "plots": [Path(p).name for p in plots]}
    files[1].write_text(json.dumps(record, indent=1) + "\n")
    files[2].write_text(markdown(result, summary, best, plots))
    return tuple(str(p) for p in files + list(plots))
