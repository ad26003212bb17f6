"""The interleaved A/B that the recorded comparisons under benchmarks/results/ run: several engines on one shared
target, prompt by prompt in a rotating order after a warm-up, every output checked against the engine named "plain";
throughput ratio = total tokens / total time against plain's in the same run. (The A/B scripts recorded before this
module each keep their own copy of this loop, as they ran.)

    from interleaved_ab import run_interleaved, summarize, write_json
    rows = run_interleaved({"plain": plain, "new": engine}, prompts, max_new_tokens=256)
    summary = summarize(rows, ["humaneval"], ["plain", "new"])
"""
import json
import platform
import time


def run_interleaved(engines: dict, prompts, max_new_tokens: int, warmup_text=None, after_warmup=None) -> list:
    """One row per (prompt, engine); `engines` must hold "plain". Prints a line per prompt. The warm-up runs
    `warmup_text` (default: the first prompt) on every engine, then `after_warmup(engines)` if given (e.g. to clear
    what a drafter kept from it)."""
    for e in engines.values():  # warm-up: first calls pay one-off costs
        e.generate(warmup_text or prompts[0].text, max_new_tokens=32)
    if after_warmup is not None:
        after_warmup(engines)
    rows, names = [], list(engines)
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        got = {}
        for m in order:
            engines[m].target.reset()  # every method prefills (a target keeps the last prompt's prefill otherwise)
            t0 = time.perf_counter()
            r = engines[m].generate(p.text, max_new_tokens=max_new_tokens)
            wall = time.perf_counter() - t0
            got[m] = {"method": m, "dataset": p.dataset, "prompt_id": p.prompt_id, "wall_s": wall,
                      "tokens": len(r.token_ids), "ids": r.token_ids, "rounds": r.num_rounds,
                      "target_passes": r.target_forward_passes, "drafter_passes": r.drafter_forward_passes,
                      "off_rounds": r.speculation_off_rounds, "hidden_state_rounds": r.hidden_state_rounds,
                      "drafted": r.drafted_tokens, "accepted": r.accepted_tokens,
                      "draft_s": r.draft_time_s, "verify_s": r.verify_time_s}
        for m in names:
            got[m]["equal_plain"] = got[m]["ids"] == got["plain"]["ids"]
        for m in names:
            got[m].pop("ids")
            rows.append(got[m])
        print(i, p.dataset, " ".join(f"{m}:{got[m]['wall_s']:.2f}/{got[m]['target_passes']}" for m in names), flush=True)
    return rows


def summarize(rows: list, sets, names) -> dict:
    """Per set and "all", per method: tok/s, throughput ratio over plain, median per-prompt ratio, tokens and drafts a
    round, acceptance, passes a prompt, the share of rounds speculation was off, and whether every output equalled
    plain's."""
    summary = {}
    for ds in list(sets) + ["all"]:
        sel = [r for r in rows if ds == "all" or r["dataset"] == ds]
        plain = [r for r in sel if r["method"] == "plain"]
        base = sum(r["tokens"] for r in plain) / sum(r["wall_s"] for r in plain)
        plain_wall = {r["prompt_id"]: r["wall_s"] for r in plain}
        summary[ds] = {}
        for m in names:
            mine = [r for r in sel if r["method"] == m]
            tokens, wall, rounds = (sum(r[k] for r in mine) for k in ("tokens", "wall_s", "rounds"))
            drafted = sum(r["drafted"] for r in mine)
            ratios = sorted(plain_wall[r["prompt_id"]] / r["wall_s"] for r in mine)
            summary[ds][m] = {"tok_s": round(tokens / wall, 2), "ratio": round(tokens / wall / base, 4),
                              "per_prompt_ratio_median": round(ratios[len(ratios) // 2], 4),
                              "tokens_per_round": round(tokens / rounds, 3),
                              "drafted_per_round": round(drafted / rounds, 3),
                              "accepted_per_drafted": round(sum(r["accepted"] for r in mine) / max(1, drafted), 3),
                              "target_passes_per_prompt": round(sum(r["target_passes"] for r in mine) / len(mine), 1),
                              "drafter_passes_per_prompt": round(sum(r["drafter_passes"] for r in mine) / len(mine), 1),
                              "off_share": round(sum(r["off_rounds"] for r in mine) / rounds, 4),
                              "all_equal_plain": all(r["equal_plain"] for r in mine)}
        print(ds, json.dumps(summary[ds]), flush=True)
    return summary


def write_json(path, args: dict, summary: dict, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "args": args, "summary": summary,
                   "rows": rows}, f, indent=1)
