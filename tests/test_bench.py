"""`diffspec bench`: prompt sets, method specs and sweeps, summary statistics, a tiny end-to-end run
with every output file, the built-in lossless check, and CLI errors. Tiny models only (fast)."""

import json
from collections import Counter

import pytest
import torch

from conftest import make_model, reference_greedy
from helpers import AlternatingPolicy
from diffspec import AutoregressiveDrafter, DiffspecError, SpeculativeEngine, make_policy
from diffspec.bench import (METHODS, BenchConfig, MethodDef, Param, best_per_dataset, expand_methods,
                            load_bench_prompts, load_jsonl_prompts, run_bench, summarize)
from diffspec.bench.runners import EngineRunner, Outcome
from diffspec.bench.specs import parse_method
from diffspec.cli import main
from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter

ROW_KEYS = {"method", "dataset", "prompt_id", "wall_time_s", "new_tokens", "tokens_per_s", "mean_accepted_length",
            "target_forward_passes", "drafter_forward_passes", "token_ids", "lossless", "speedup", "draft_time_s",
            "verify_time_s", "round_drafted", "round_accepted", "speculation_off_rounds", "draft_length_histogram",
            "hidden_state_rounds", "pass_round_draft_time_s"}
SUMMARY_ROUND_KEYS = {"rounds", "speculation_off_rounds", "speculation_off_share", "draft_length_histogram",
                      "hidden_state_rounds"}


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"id": "copy", "prompt": "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"}, {"text": "w10 w11 w12 w13"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def tiny_block_method():
    """A registry entry with a tiny block-diffusion drafter + FailFast (the shipped random one is too big)."""
    def build(target, values):
        v = target.vocab_size
        drafter = BlockDiffusionDrafter(make_model(v + 1, seed=3, std=0.5),
                                        BlockDiffusionConfig(mask_token_id=v, block_size=8, sub_block_size=4),
                                        name="tiny-block")
        return EngineRunner(SpeculativeEngine(target, drafter, make_policy("failfast", tau=values["tau"], n=4,
                                                                           n_max=12)))
    return MethodDef("tiny-block", "test drafter", (Param("tau", float, 0.45),), build)


def alternating_method():
    """The target drafting for itself (every draft accepted), speculation switched off every other round."""
    def build(target, values):
        drafter = AutoregressiveDrafter(target.model, target.tokenizer, name="ar:self")
        return EngineRunner(SpeculativeEngine(target, drafter, AlternatingPolicy(gamma=3)))
    return MethodDef("alternating", "self-drafting, speculation off every other round", (), build)


def check_round_fields(row):
    """What every row's speculation-off count and draft-length histogram must agree with."""
    hist, off = row["draft_length_histogram"], row["speculation_off_rounds"]
    assert all(isinstance(k, str) for k in hist)  # as JSON writes them: the file and the rows agree
    assert hist == {str(k): n for k, n in sorted(Counter(row["round_drafted"]).items())}
    assert sum(hist.values()) == (row["rounds"] or 0)
    assert sum(int(k) * n for k, n in hist.items()) == row["drafted_tokens"]
    assert 0 <= off <= hist.get("0", 0)  # an off round verifies no drafted token
    assert 0 <= row["hidden_state_rounds"] <= (row["rounds"] or 0)
    if row["pass_round_draft_time_s"] is not None:  # engine rows: part of the drafting time, none without a pass
        assert 0 <= row["pass_round_draft_time_s"] <= row["draft_time_s"] + 1e-5
        assert row["pass_round_draft_time_s"] == 0 or row["drafter_forward_passes"] > 0


def check_summary_round_fields(entry, rows):
    """A summary entry's round figures are the sums of its rows'."""
    rows = [r for r in rows if r["method"] == entry["method"] and entry["dataset"] in ("all", r["dataset"])]
    rounds = sum(r["rounds"] or 0 for r in rows)
    assert entry["rounds"] == (rounds or None)
    assert entry["speculation_off_rounds"] == sum(r["speculation_off_rounds"] for r in rows)
    assert entry["speculation_off_share"] == (round(entry["speculation_off_rounds"] / rounds, 4) if rounds else None)
    assert entry["hidden_state_rounds"] == sum(r["hidden_state_rounds"] for r in rows)
    total = Counter()
    for r in rows:
        total.update({k: n for k, n in r["draft_length_histogram"].items()})
    assert entry["draft_length_histogram"] == {k: total[k] for k in sorted(total, key=int)}
    assert list(entry["draft_length_histogram"]) == sorted(entry["draft_length_histogram"], key=int)


def broken_method():
    """Plain decoding whose last token is deliberately changed: the lossless check must catch it."""
    class Broken(EngineRunner):
        def run(self, prompt_ids, max_new_tokens, sampling):
            o = super().run(prompt_ids, max_new_tokens, sampling)
            ids = o.token_ids[:-1] + ((o.token_ids[-1] + 1) % 60 + 4,)
            return Outcome(ids, o.wall_time_s, o.target_forward_passes, 0, 1.0, o.draft_time_s, o.verify_time_s,
                           o.rounds, o.finish_reason)
    return MethodDef("broken", "alters the output", (), lambda target, values: Broken(SpeculativeEngine(target)))


# --- prompt sets -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,count", [("humaneval", 164), ("mtbench", 80), ("champ", 270)])
def test_packaged_prompt_sets(name, count):
    prompts = load_bench_prompts(name, None)
    assert len(prompts) == count and len({p.prompt_id for p in prompts}) == count
    assert all(p.dataset == name and p.text.strip() for p in prompts)


def test_all_takes_the_first_n_of_each_set():
    prompts = load_bench_prompts("all", 2)
    assert [p.dataset for p in prompts] == ["humaneval"] * 2 + ["mtbench"] * 2 + ["champ"] * 2


def test_comma_separated_sets_and_files_keep_their_names(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    prompts = load_bench_prompts(f"humaneval, {f}", 1)
    assert [(p.dataset, p.text) for p in prompts][1:] == [("mine", "a")]
    assert prompts[0].dataset == "humaneval"
    with pytest.raises(DiffspecError, match="unknown dataset 'nope'"):
        load_bench_prompts("mtbench,nope", 1)


def test_jsonl_prompts(tmp_path, prompt_file):
    assert load_jsonl_prompts(prompt_file) == [("copy", "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"), ("line2", "w10 w11 w12 w13")]
    other = tmp_path / "other.jsonl"
    other.write_text('{"question": "q?"}\n{"turns": ["first", "second"], "id": 7}\n')
    assert load_jsonl_prompts(other) == [("line1", "q?"), ("7", "first")]
    assert [p.dataset for p in load_bench_prompts(str(other), 1)] == ["other"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"answer": "no prompt"}\n')
    with pytest.raises(DiffspecError, match="bad.jsonl:2"):
        load_jsonl_prompts(bad)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(DiffspecError, match="bad.jsonl:2: not valid JSON"):
        load_jsonl_prompts(bad)
    with pytest.raises(DiffspecError, match="not found"):
        load_jsonl_prompts(tmp_path / "missing.jsonl")


# --- methods and sweeps ------------------------------------------------------------------------

def test_method_specs_and_sweep():
    specs = expand_methods(["failfast", "conditioned:gamma=16", "hf-generate"], ["tau=0.3,0.6", "n_max=30,60"])
    names = [s.name for s in specs]
    assert names[0] == "plain"  # added and first
    assert "failfast[tau=0.3,n_max=30]" in names and "failfast[tau=0.6,n_max=60]" in names
    assert sum(n.startswith("failfast[") for n in names) == 4
    assert "conditioned:gamma=16" in names and "hf-generate" in names  # accept neither tau nor n_max
    variant = next(s for s in specs if s.name == "failfast[tau=0.6,n_max=30]")
    assert variant.values(METHODS) == {"drafter": "block-diffusion", "drafter_dtype": "auto", "tau": 0.6,
                                        "n": 10, "n_max": 30}
    with pytest.raises(DiffspecError, match="no parameter 'gamma'"):
        expand_methods(["failfast:gamma=4"])
    with pytest.raises(DiffspecError, match="listed twice"):
        expand_methods(["plain", "plain"])
    with pytest.raises(DiffspecError, match="accepts that parameter"):
        expand_methods(["plain", "hf-generate"], ["tau=0.3"])


def test_a_setting_the_methods_policy_would_not_read_is_refused():
    assert parse_method("conditioned:policy=auto").values(METHODS)["policy"] == "auto"
    assert parse_method("conditioned:gamma=3").values(METHODS)["gamma"] == 3  # fixed by default
    for spec, ignored, policy in (("conditioned:policy=auto,gamma=3", "gamma", "auto"),
                                  ("conditioned:tau=0.3", "tau", "fixed"),
                                  ("prompt-lookup:gamma=4", "gamma", "failfast"),
                                  ("combined:n_max=30", "n_max", "auto")):
        with pytest.raises(DiffspecError, match=f"{ignored} does not apply to the {policy} policy"):
            parse_method(spec)
    # a sweep expands only the methods whose policy reads the key
    with pytest.raises(DiffspecError, match=r"--sweep tau: none of the methods prompt-lookup:policy=auto accepts"):
        expand_methods(["prompt-lookup:policy=auto"], ["tau=0.3"])
    names = [m.name for m in expand_methods(["prompt-lookup", "prompt-lookup:policy=auto"], ["tau=0.3,0.6"])]
    assert names == ["plain", "prompt-lookup[tau=0.3]", "prompt-lookup[tau=0.6]", "prompt-lookup:policy=auto"]


def test_every_method_that_names_a_policy_accepts_auto():
    assert parse_method("auto").values(METHODS) == {"drafter_dtype": "auto"}
    combined = parse_method("combined:policy=failfast").values(METHODS)
    assert combined["policy"] == "failfast" and combined["drafter"] == "prompt-lookup+conditioned"
    assert parse_method("combined").values(METHODS)["policy"] == "auto"
    assert parse_method("prompt-lookup:policy=auto").values(METHODS)["policy"] == "auto"
    assert parse_method("ar:drafter=x,policy=auto").values(METHODS)["policy"] == "auto"
    for method in METHODS.values():
        if method.accepts("policy"):
            assert "auto" in method.param("policy").help
    with pytest.raises(DiffspecError, match=r"unknown policy 'bogus' \(choose from: auto, fixed, failfast\)"):
        parse_method("prompt-lookup:policy=bogus")
    with pytest.raises(DiffspecError, match="two drafters or more as A\\+B"):
        parse_method("combined:drafter=prompt-lookup")


# --- summary statistics ------------------------------------------------------------------------

def _row(method, dataset, speedup, lossless=True, acc=1.5, prompt_id=None, new_tokens=10):
    return {"method": method, "dataset": dataset, "prompt_id": prompt_id or f"p{speedup}", "speedup": speedup,
            "wall_time_s": 1.0 / speedup, "new_tokens": new_tokens, "mean_accepted_length": acc,
            "target_forward_passes": 8, "drafter_forward_passes": 4, "lossless": lossless}


def test_summary_statistics_on_hand_made_rows():
    rows = [_row("plain", "a", 1.0, prompt_id="p1"), _row("plain", "a", 1.0, prompt_id="p2"),
            _row("plain", "a", 1.0, prompt_id="p3"), _row("x", "a", 1.0, prompt_id="p1"),
            _row("x", "a", 2.0, prompt_id="p2"), _row("x", "a", 4.5, prompt_id="p3"),
            _row("fast-but-wrong", "a", 9.0, lossless=False, prompt_id="p1"),
            _row("plain", "b", 1.0, prompt_id="q1"), _row("x", "b", 0.5, prompt_id="q1")]
    summary = {(s["dataset"], s["method"]): s for s in summarize(rows)}
    x = summary[("a", "x")]
    assert (x["prompts"], x["speedup_mean"], x["speedup_median"], x["speedup_min"], x["speedup_max"]) == \
        (3, 2.5, 2.0, 1.0, 4.5)
    assert x["tokens_per_s"] == round(30 / (1 + 0.5 + 1 / 4.5), 3) and x["lossless"] is True
    assert x["throughput_ratio"] == round(3 / (1 + 0.5 + 1 / 4.5), 4)  # same tokens: plain's total time / x's
    assert summary[("all", "x")]["prompts"] == 4 and summary[("all", "x")]["speedup_median"] == 1.5
    assert summary[("a", "plain")]["throughput_ratio"] == 1.0
    assert summary[("a", "fast-but-wrong")]["lossless"] is False
    # picked by throughput ratio; the lossy one is never best; on b, x (0.5x) loses to plain
    assert best_per_dataset(summarize(rows)) == {"a": "x", "b": "plain", "all": "x"}
    without_plain = summarize([r for r in rows if r["method"] != "plain"])
    assert {s["throughput_ratio"] for s in without_plain} == {None}
    assert best_per_dataset(without_plain) == {"a": "x", "b": "x", "all": "x"}  # falls back to the median
    sampled = summarize([dict(r, lossless=None) for r in rows[:2]])
    assert sampled[0]["lossless"] is None


def test_throughput_ratio_weighs_prompts_by_time_not_like_the_mean_of_ratios():
    """One long slow prompt the method does not speed up, one short one it speeds up 4x: the mean of
    per-prompt ratios says 2.5x, the throughput ratio (total tokens / total time vs plain) 11/10.25."""
    from types import SimpleNamespace

    from diffspec.bench.report import markdown

    def row(method, dataset, prompt_id, new_tokens, wall, plain_wall):
        return dict(_row(method, dataset, 1.0, prompt_id=prompt_id, new_tokens=new_tokens), wall_time_s=wall,
                    speedup=round(plain_wall / wall, 4))

    rows = [row("plain", "a", "long", 200, 10.0, 10.0), row("x", "a", "long", 200, 10.0, 10.0),
            row("short-answers", "a", "long", 100, 5.0, 10.0),
            row("plain", "a", "short", 20, 1.0, 1.0), row("x", "a", "short", 20, 0.25, 1.0),
            row("short-answers", "a", "short", 20, 1.0, 1.0),
            # same prompt id in another set: rows pair with plain by (dataset, prompt_id)
            row("plain", "b", "long", 100, 4.0, 4.0), row("x", "b", "long", 100, 2.0, 4.0)]
    summary = {(s["dataset"], s["method"]): s for s in summarize(rows)}
    x = summary[("a", "x")]
    assert x["speedup_mean"] == 2.5 and (x["speedup_min"], x["speedup_max"]) == (1.0, 4.0)
    assert x["throughput_ratio"] == round(11 / 10.25, 4) == 1.0732  # (220 / 10.25 s) / (220 / 11 s)
    # per prompt 2x and 1x in time, but half the tokens on the long one: the same tokens per second
    assert summary[("a", "short-answers")]["speedup_mean"] == 1.5
    assert summary[("a", "short-answers")]["throughput_ratio"] == 1.0
    assert summary[("b", "x")]["throughput_ratio"] == 2.0
    assert summary[("all", "x")]["throughput_ratio"] == round(15 / 12.25, 4) == 1.2245  # (320/12.25) / (320/15)
    assert best_per_dataset(list(summary.values()))["a"] == "x"

    result = SimpleNamespace(
        rows=rows, methods=(), failures=(),
        machine={"cpu": "cpu", "cpus": 2, "cpu_flags": {"avx2": True}, "threads": 2, "torch": "t",
                 "transformers": "tf", "python": "3", "commit": "c"},
        settings={"command": "diffspec bench (test)", "target": "tiny", "target_dtype": "float32", "prompts": 3,
                  "dataset": "a", "max_new_tokens": 200, "temperature": 0.0, "seed": None, "repeats": 1})
    md = markdown(result, list(summary.values()), best_per_dataset(list(summary.values())), [])
    header = next(line for line in md.splitlines() if line.startswith("| dataset |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[3:7] == ["throughput ratio", "per-prompt speedup mean", "median", "min-max"]
    assert "| a | x | 2 | 1.07x | 2.50x | 2.50x | 1.00-4.00 |" in md


def test_speedup_plot_bars_are_throughput_ratios_with_per_prompt_whiskers(tmp_path, monkeypatch):
    import sys

    pytest.importorskip("matplotlib")
    from diffspec.bench import plots

    drawn = []
    summary = [{"dataset": "a", "method": "plain", "throughput_ratio": 1.0, "speedup_median": 1.0,
                "speedup_min": 1.0, "speedup_max": 1.0},
               {"dataset": "a", "method": "y", "throughput_ratio": 0.9, "speedup_median": 1.5,  # below its min:
                "speedup_min": 1.0, "speedup_max": 2.0}]                                       # fewer tokens
    plt = plots._pyplot(sys.stderr)
    real_subplots = plt.subplots

    def subplots(*args, **kwargs):  # record what each bar call draws, then draw it
        fig, ax = real_subplots(*args, **kwargs)
        real_bar = ax.bar

        def bar(xs, heights, width, yerr, **kw):
            drawn.append((list(heights), yerr))
            return real_bar(xs, heights, width, yerr=yerr, **kw)

        ax.bar = bar
        return fig, ax

    monkeypatch.setattr(plt, "subplots", subplots)
    plots.plot_speedup(plt, summary, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert drawn[0] == ([1.0], [[0.0], [0.0]])
    assert drawn[1][0] == [0.9] and drawn[1][1][0] == [0.0] and drawn[1][1][1] == [pytest.approx(1.1)]


def test_round_profile_splits_wall_time_per_round():
    from diffspec.bench.report import round_profile
    rows = [dict(_row("x", "a", 1.0), wall_time_s=1.0, rounds=10, draft_time_s=0.2, verify_time_s=0.6,
                 prefill_time_s=0.1, new_tokens=25),
            dict(_row("x", "b", 1.0), wall_time_s=3.0, rounds=30, draft_time_s=0.6, verify_time_s=1.8,
                 prefill_time_s=0.3, new_tokens=75),
            dict(_row("hf", "a", 1.0), rounds=None, draft_time_s=None, verify_time_s=None)]
    (p,) = round_profile(rows)  # HF methods cannot be split, so they are left out
    assert p["method"] == "x" and p["rounds"] == 40 and p["tokens_per_round"] == 2.5
    assert (p["ms_per_round"], p["draft_ms"], p["verify_ms"], p["prefill_ms"], p["other_ms"]) == (100, 20, 60, 10, 10)
    assert p["ms_per_drafter_pass"] == round(1000 * 0.8 / 8, 2)  # rows that cannot tell: all drafting time


def test_ms_per_drafter_pass_counts_only_the_rounds_that_ran_a_pass():
    """A combined drafter's pass-free part (prompt lookup) drafts in every round; the diffusion part's passes are
    rare. All drafting time over the passes made one 10 ms pass read 300 ms (the twelfth session's bench)."""
    from diffspec.bench.report import round_profile
    rows = [dict(_row("combo", "a", 1.0), wall_time_s=1.0, rounds=100, draft_time_s=0.03, verify_time_s=0.8,
                 prefill_time_s=0.1, new_tokens=150, drafter_forward_passes=1, pass_round_draft_time_s=0.0101)]
    (p,) = round_profile(rows)
    assert p["ms_per_drafter_pass"] == 10.1 and p["draft_ms"] == 0.3


# --- end to end --------------------------------------------------------------------------------

def test_bench_end_to_end_writes_every_output(target, prompt_file, tmp_path, capsys):
    registry = dict(METHODS, **{"tiny-block": tiny_block_method()})
    config = BenchConfig(dataset=str(prompt_file), num_prompts=2, max_new_tokens=12, repeats=2,
                         methods=("hf-generate", "hf-prompt-lookup", "prompt-lookup:policy=fixed,gamma=4",
                                  "conditioned", "tiny-block"),
                         sweep=("tau=0.0,0.9",), raster_prompt="copy", command="diffspec bench (test)")
    out = tmp_path / "out"
    result = run_bench(config, target, registry=registry, out=str(out))
    assert result.exit_code == 0 and not result.failures
    # the fixed policy reads no tau, so the sweep leaves prompt-lookup:policy=fixed as it is
    names = ["plain", "hf-generate", "hf-prompt-lookup", "prompt-lookup:policy=fixed,gamma=4",
             "conditioned", "tiny-block[tau=0.0]", "tiny-block[tau=0.9]"]
    for f in ("results.jsonl", "summary.md", "summary.json", "speedup.png", "accepted_length.png", "raster.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert (out / "raster.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(names) * 2 and [r["method"] for r in rows[:len(names)]] == names
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["lossless"] is True and r["dataset"] == "mine" and len(r["wall_times_s"]) == 2
        assert r["new_tokens"] == len(r["token_ids"]) > 0 and r["target_forward_passes"] > 0
        check_round_fields(r)
        assert r["speculation_off_rounds"] == 0  # no policy here switches speculation off
    by = {(r["method"], r["prompt_id"]): r for r in rows}
    plain = by[("plain", "copy")]
    assert plain["draft_length_histogram"] == {"0": plain["rounds"]} and plain["rounds"] == plain["new_tokens"]
    assert by[("hf-generate", "copy")]["draft_length_histogram"] == {}  # HF methods count no rounds
    assert sum(by[("tiny-block[tau=0.0]", "copy")]["draft_length_histogram"].values()) > 0
    assert by[("plain", "copy")]["speedup"] == 1.0 and by[("plain", "copy")]["mean_accepted_length"] == 1.0
    hf = by[("hf-generate", "copy")]
    assert hf["target_forward_passes"] == hf["new_tokens"] and hf["draft_time_s"] is None  # counted by the hook
    assert by[("tiny-block[tau=0.9]", "copy")]["drafter_forward_passes"] > 0
    assert sum(by[("tiny-block[tau=0.0]", "copy")]["round_drafted"]) > 0

    record = json.loads((out / "summary.json").read_text())
    assert record["command"] == "diffspec bench (test)" and record["lossless_failures"] == []
    assert {"cpu", "cpu_flags", "threads", "torch", "transformers", "commit"} <= set(record["machine"])
    assert set(record["machine"]["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert record["best"]["mine"] in names and len(record["summary"]) == len(names)
    for entry in record["summary"]:
        assert SUMMARY_ROUND_KEYS <= set(entry)
        check_summary_round_fields(entry, rows)
    entries = {e["method"]: e for e in record["summary"]}
    assert entries["plain"]["speculation_off_share"] == 0.0
    assert list(entries["plain"]["draft_length_histogram"]) == ["0"]
    assert entries["hf-generate"]["rounds"] is None and entries["hf-generate"]["speculation_off_share"] is None
    ratios = {e["method"]: e["throughput_ratio"] for e in record["summary"]}
    assert ratios["plain"] == 1.0 and all(isinstance(v, float) and v > 0 for v in ratios.values())
    weights = {m["name"]: m for m in record["methods"]}
    assert "random" in weights["conditioned"]["weights"] and weights["conditioned"]["notes"]  # which weights ran
    md = (out / "summary.md").read_text()
    assert "diffspec bench (test)" in md and "Machine:" in md and "**best**" in md and "| mine | conditioned |" in md
    assert "| dataset | method | prompts | throughput ratio | per-prompt speedup mean | median | min-max |" in md
    assert "| dataset | method | rounds | speculation off | share off | k histogram |" in md
    assert f"| mine | plain | {entries['plain']['rounds']} | 0 | 0.0% | k0:{entries['plain']['rounds']} |" in md
    lengths = md.split("## Draft lengths")[1].split("## Methods")[0]
    assert "| mine | tiny-block[tau=0.0] |" in lengths and "hf-" not in lengths  # HF methods count no rounds


def test_speculation_off_rounds_are_counted_and_the_output_stays_the_targets(target, tiny_model, prompt_file, tmp_path):
    registry = dict(METHODS, alternating=alternating_method())
    config = BenchConfig(dataset=str(prompt_file), num_prompts=2, max_new_tokens=16, methods=("alternating",),
                         quiet=True)
    out = tmp_path / "out"
    result = run_bench(config, target, registry=registry, out=str(out))
    assert result.exit_code == 0
    prompts = {p.prompt_id: p.text for p in load_bench_prompts(str(prompt_file), 2)}
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["method"] == "alternating"]
    assert len(mine) == 2
    for r in mine:
        check_round_fields(r)
        ids = target.encode_prompt(prompts[r["prompt_id"]], chat=True)
        assert r["token_ids"] == reference_greedy(tiny_model, ids, 16) and r["lossless"] is True
        drafted = r["round_drafted"]
        assert drafted[0] == 3 and all(k == 0 for k in drafted[1::2])  # every other round is a plain step
        off = r["speculation_off_rounds"]
        assert off > 0 and abs(off - r["rounds"] // 2) <= 1  # the last round (no room to draft) is not "off"
        assert r["drafted_tokens"] > 0 and r["accepted_tokens"] == r["drafted_tokens"]  # on rounds did draft
    record = json.loads((out / "summary.json").read_text())
    for entry in record["summary"]:
        check_summary_round_fields(entry, rows)
    entry = next(e for e in record["summary"] if e["method"] == "alternating")
    assert entry["speculation_off_rounds"] == sum(r["speculation_off_rounds"] for r in mine) > 0
    assert 0.3 < entry["speculation_off_share"] < 0.6
    md = (out / "summary.md").read_text()
    assert (f"| mine | alternating | {entry['rounds']} | {entry['speculation_off_rounds']} | "
            f"{100 * entry['speculation_off_share']:.1f}% | k0:") in md


def test_auto_and_combined_methods_run_lossless(target, prompt_file, tmp_path, monkeypatch):
    """The default method and combined drafters, with the auto policy (which measures this machine's costs:
    into a scratch cache) and with FailFast; each row's round figures agree with one another."""
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path / "cache"))
    config = BenchConfig(dataset=str(prompt_file), num_prompts=1, max_new_tokens=10, quiet=True,
                         methods=("auto", "combined", "prompt-lookup:policy=auto", "combined:policy=failfast"))
    result = run_bench(config, target)
    assert result.exit_code == 0 and {r["lossless"] for r in result.rows} == {True}
    methods = {m["name"]: m for m in result.methods}
    assert methods["auto"]["policy"].startswith("auto(") and methods["auto"]["weights"].startswith("prompt-lookup")
    assert methods["combined"]["policy"].startswith("auto(") and "+conditioned" in methods["combined"]["weights"]
    assert methods["prompt-lookup:policy=auto"]["policy"].startswith("auto(")
    assert methods["combined:policy=failfast"]["policy"].startswith("failfast(")
    for r in result.rows:
        check_round_fields(r)
        assert r["rounds"] > 0
    for entry in summarize(result.rows):
        check_summary_round_fields(entry, result.rows)


def test_sampling_leaves_lossless_null(target, prompt_file):
    config = BenchConfig(dataset=str(prompt_file), num_prompts=1, max_new_tokens=6, temperature=0.8, seed=1,
                         methods=("plain", "prompt-lookup"), quiet=True)
    result = run_bench(config, target)
    assert result.exit_code == 0 and {r["lossless"] for r in result.rows} == {None}


def test_lossless_check_catches_a_deviating_method(target, prompt_file, tmp_path, capsys):
    registry = dict(METHODS, broken=broken_method())
    config = BenchConfig(dataset=str(prompt_file), num_prompts=2, max_new_tokens=6, methods=("plain", "broken"),
                         quiet=True)
    result = run_bench(config, target, registry=registry, out=str(tmp_path / "out"))
    assert result.exit_code == 1 and len(result.failures) == 2
    err = capsys.readouterr().err
    assert err.count("LOSSLESS FAILURE: broken differs from plain") == 2
    rows = {r["method"]: r for r in result.rows if r["prompt_id"] == "copy"}
    assert rows["plain"]["lossless"] is True and rows["broken"]["lossless"] is False
    assert rows["broken"]["first_difference"] == rows["broken"]["new_tokens"] - 1
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(record["lossless_failures"]) == 2 and record["best"]["mine"] == "plain"
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "LOSSLESS FAILURES" in md
    # the parity rate beside the verdict (what a bfloat16 target reports): here no prompt stayed identical
    broken = [e for e in record["summary"] if e["method"] == "broken" and e["dataset"] == "mine"][0]
    assert (broken["identical_prompts"], broken["compared_prompts"]) == (0, 2)
    assert "| **NO** (0/2 identical) |" in md


def test_a_bfloat16_target_says_in_every_result_that_its_speculative_output_can_part_from_plain():
    """bfloat16 passes of several rows round unlike one-token steps (pitfalls: exact in fp32, not in fp16/bf16), so
    an engine that drafts on such a target says so in its results' notes; float32 and float64 say nothing."""
    from diffspec import PromptLookupDrafter, Target

    for dtype, noted in ((torch.bfloat16, True), (torch.float32, False), (torch.float64, False)):
        target = Target(make_model(64, seed=3, dtype=dtype))
        engine = SpeculativeEngine(target, PromptLookupDrafter(), make_policy("fixed", gamma=3))
        result = engine.generate([5, 6, 7, 5, 6], max_new_tokens=4, stop_token_ids=[])
        note = [n for n in result.notes if "round differently from its one-token steps" in n]
        assert bool(note) == noted, dtype
        if noted:
            assert "bfloat16" in note[0] and "--dtype float32" in note[0]
        assert not [n for n in SpeculativeEngine(target).generate([5, 6], max_new_tokens=2).notes
                    if "one-token steps" in n]  # plain decoding: nothing to part from


# --- the command line --------------------------------------------------------------------------

def test_cli_exits_1_on_a_lossless_failure(tiny_model_dir, prompt_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(METHODS, "broken", broken_method())
    rc = main(["bench", "--model", str(tiny_model_dir), "--dataset", str(prompt_file), "--num-prompts", "1",
               "--max-new-tokens", "5", "--methods", "broken", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 1
    assert "LOSSLESS FAILURE" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["settings"]["methods"] == ["plain", "broken"]


def test_cli_list_methods(capsys):
    assert main(["bench", "--list-methods"]) == 0
    out = capsys.readouterr().out
    for name in ("hf-generate", "plain", "hf-prompt-lookup", "auto", "combined", "prompt-lookup", "ar", "specdiff",
                 "dllm-fixed", "failfast", "conditioned", "conditioned-failfast"):
        assert f"\n{name} " in "\n" + out


@pytest.mark.parametrize("args,message", [
    (["--methods", "plain", "warp-drive"], "unknown method 'warp-drive'"),
    (["--methods", "failfast:gamma=4"], "method 'failfast' has no parameter 'gamma'"),
    (["--methods", "conditioned:gamma=many"], "parameter gamma must be an integer"),
    (["--methods", "ar"], "needs drafter="),
    (["--methods", "conditioned:drafter=/no/such/drafter"], "drafter folder not found: /no/such/drafter"),
    (["--methods", "prompt-lookup:min_ngram=0"], "parameter min_ngram must be >= 1, got 0"),
    (["--methods", "prompt-lookup:max_ngram=1,min_ngram=3"], "need min_ngram <= max_ngram, got 3 and 1"),
    (["--methods", "specdiff:steps=0"], "parameter steps must be >= 1, got 0"),
    (["--methods", "failfast:tau=nan"], "parameter tau must be in [0, 1], got nan"),
    (["--methods", "conditioned:gamma=-1"], "parameter gamma must be >= 0, got -1"),
    (["--methods", "failfast:n=20,n_max=5"], "need n <= n_max, got 20 and 5"),
    (["--methods", "failfast", "--sweep", "tau=0.3,7"], "parameter tau must be in [0, 1], got 7.0"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--methods", "ar:drafter=/no/such/model.gguf"], "drafter path not found: /no/such/model.gguf"),
    (["--methods", "conditioned:drafter_dtype=fp8"], "unknown drafter dtype 'fp8'"),
    (["--methods", "combined:policy=greedy"], "unknown policy 'greedy'"),
    (["--sweep", "tau"], "--sweep takes PARAM=V1,V2"),
    (["--dataset", "EMPTY"], "has no prompts"),
    (["--dataset", "nowhere.jsonl"], "prompt file not found"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    rc = main(["bench", "--out", str(tmp_path / "o"), "--model", "/no/such/model"] + args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffspec: error: ") and message in lines[0]


def test_an_out_that_is_a_file_is_refused_before_anything_loads(tmp_path, capsys):
    (tmp_path / "results.txt").write_text("mine")
    rc = main(["bench", "--out", str(tmp_path / "results.txt"), "--model", "/no/such/model"])
    err = capsys.readouterr().err
    assert rc == 2 and "exists and is not a folder" in err and (tmp_path / "results.txt").read_text() == "mine"


def test_plots_are_skipped_with_a_warning_without_matplotlib(tmp_path, monkeypatch, capsys):
    import sys

    from diffspec.bench.plots import make_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rows = [dict(_row("plain", "a", 1.0), round_emitted=[1], drafted_tokens=0)]
    assert make_plots(rows, summarize(rows), tmp_path, stderr=sys.stderr) == []
    assert "matplotlib is not installed: skipping plots" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_methods_table_says_what_a_block_limited_drafter_voids(target):
    """The engine's notes (issue 15) reach the bench's Methods notes: a conditioned drafter with
    block 16 drafts at most 15 tokens a round, so FailFast's N_max=60 and gamma 20 say so."""
    import warnings

    from diffspec.bench.specs import build_runner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = expand_methods(["conditioned-failfast", "conditioned:gamma=20", "conditioned:gamma=8"])
        notes = {s.name: build_runner(s, target)[1] for s in specs}
    assert any("N_max=60 acts as 15" in n for n in notes["conditioned-failfast"])
    assert any("gamma 20 drafts 15" in n for n in notes["conditioned:gamma=20"])
    assert not any("drafts" in n or "acts as" in n for n in notes["conditioned:gamma=8"])
