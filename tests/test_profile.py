"""`diffspec profile`: the verify cost table and drafter costs, cached per machine x model x dtype (x drafter)."""

import json

import pytest
import torch

from conftest import make_model
from diffspec import Target, costs
from diffspec.cli import main
from diffspec.errors import DiffspecError
from diffspec.policies import auto
from diffspec.profile import MIN_CONTEXT, profile_target, write_profile

REAL_MEASURE = costs.measure_verify_costs


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DIFFSPEC_COST_CACHE", raising=False)
    return tmp_path / "cache" / "costs"


@pytest.fixture()
def measured(monkeypatch):
    """Count verify measurements, each a short ladder (the full one is tested once, below)."""
    calls = []

    def quick(target, progress=False, **kw):
        calls.append(target.name)
        return REAL_MEASURE(target, ks=(0, 1, 2, 4), contexts=(16, 32), reps=1, progress=progress)

    monkeypatch.setattr(costs, "measure_verify_costs", quick)
    return calls


def refuse(what):
    def fail(*a, **k):
        raise AssertionError(f"{what} ran although its result was cached")

    return fail


def test_profile_writes_json_and_plot_then_reads_the_cache(target, cache, tmp_path, monkeypatch):
    p = profile_target(target, "prompt-lookup")
    assert p.origin == "measured" and not p.from_cache
    assert p.costs.ks == costs.VERIFY_KS and p.costs.contexts[0] == 64
    assert all(len(row) == len(p.costs.ks) for row in p.costs.verify_s)
    assert [d.origin for d in p.drafters] == ["measured"] and p.drafters[0].rounds > 0
    assert p.drafters[0].fixed_s >= 0 and p.drafters[0].per_token_s >= 0
    files = sorted(f.name for f in cache.glob("*.json"))
    assert len(files) == 2 and files[0].startswith("drafter-") and files[1].startswith("verify-")
    assert p.cache_file.endswith(files[1]) and p.drafters[0].cache_file.endswith(files[0])

    written = write_profile(p, tmp_path / "out")
    assert [w.name for w in written] == ["profile.json", "verify_cost.png"]
    assert (tmp_path / "out" / "verify_cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert data["verify"]["ks"] == list(costs.VERIFY_KS) and data["verify"]["origin"] == "measured"
    assert data["drafters"][0]["name"] == "prompt-lookup" and data["drafters"][0]["calibration"]["costs"]
    assert data["machine"] == costs.machine_key(target.device)

    # the second run reads both from the cache: nothing is timed again
    monkeypatch.setattr(costs, "measure_verify_costs", refuse("measure_verify_costs"))
    monkeypatch.setattr(auto, "calibrate_drafter", refuse("calibrate_drafter"))
    again = profile_target(target, "prompt-lookup")
    assert again.from_cache and [d.origin for d in again.drafters] == ["cache"]
    assert again.costs.verify_s == p.costs.verify_s and again.drafters[0].per_token_s == p.drafters[0].per_token_s
    text = again.table()
    assert "read from the cache" in text and "; cache)" in text
    head = next(line for line in text.splitlines() if line.strip().startswith("k |"))
    assert "ms@64" in head and "x@64" in head
    k0 = next(line for line in text.splitlines() if line.strip().startswith("0 |"))
    assert k0.split("|")[2].split() == ["1.00"] * len(p.costs.contexts)  # the ratio to k = 0
    assert "machine: " in text and p.cache_file in text


def test_a_table_is_never_reused_for_another_model_or_machine(target, tokenizer, cache, measured, monkeypatch):
    key = costs.verify_key(target)
    assert profile_target(target).origin == "measured" and measured == ["tiny"]
    assert profile_target(target).origin == "cache" and len(measured) == 1

    other = Target(make_model(len(tokenizer), seed=7), tokenizer, name="tiny")  # same name and shape, other weights
    assert costs.verify_key(other) != key
    assert profile_target(other).origin == "measured" and len(measured) == 2

    real = costs.machine_key

    def elsewhere(device):
        return {**real(device), "cpu": "another CPU", "cpu_flags": {"avx2": True, "amx_bf16": True}}

    monkeypatch.setattr(costs, "machine_key", elsewhere)
    assert costs.verify_key(target) != key
    p = profile_target(target)
    assert p.origin == "measured" and len(measured) == 3 and p.machine["cpu"] == "another CPU"
    assert len(list(cache.glob("verify-*.json"))) == 3


def test_recalibrate_measures_again(target, cache, measured, monkeypatch):
    first = profile_target(target, "prompt-lookup")
    calibrations = []
    real_calibrate = auto.calibrate_drafter

    def counting(t, d, **kw):
        calibrations.append(d.name)
        return real_calibrate(t, d, **kw)

    monkeypatch.setattr(auto, "calibrate_drafter", counting)
    p = profile_target(target, "prompt-lookup", recalibrate=True)
    assert p.origin == "measured" and len(measured) == 2 and calibrations == ["prompt-lookup"]
    assert [d.origin for d in p.drafters] == ["measured"] and p.cache_file == first.cache_file
    assert profile_target(target, "prompt-lookup").from_cache and len(measured) == 2  # and it replaced the cache


@pytest.mark.filterwarnings("ignore:no trained .conditioned. drafter")
def test_a_combined_drafter_profiles_each_part(target, cache, measured):
    p = profile_target(target, "prompt-lookup+conditioned")
    assert [d.name for d in p.drafters] == ["prompt-lookup", "conditioned (random)"]
    assert len({d.cache_file for d in p.drafters}) == 2 and all(d.origin == "measured" for d in p.drafters)


def test_a_context_too_short_to_time_is_refused(tiny_model, tokenizer, cache, measured):
    with pytest.raises(DiffspecError, match=f"at least {MIN_CONTEXT}"):
        profile_target(Target(tiny_model, tokenizer, max_context=32, name="tiny"))
    assert measured == []


@pytest.fixture()
def no_model_loads(monkeypatch):
    def refuse_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(Target, "load", refuse_load)


@pytest.mark.parametrize("argv, message", [
    (["--out", "FILE"], "exists and is not a folder"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--drafter-dtype", "int4"], "unknown drafter dtype 'int4'"),
    (["--max-context", "0"], f"--max-context must be an integer >= {MIN_CONTEXT}"),
    (["--max-context", "40"], f"--max-context must be an integer >= {MIN_CONTEXT}"),
    (["--drafter", "conditionedd"], "unknown drafter 'conditionedd'"),
    (["--drafter", "prompt-lookup+"], "each part of A+B must be a drafter"),
    (["--drafter", "prompt-lookup+none"], "each part of A+B must be a drafter"),
    (["--drafter", "prompt-lookup+./no/such/drafter"], "drafter folder not found"),
    pytest.param(["--device", "cuda"], "--device cuda asked for, but torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
])
def test_cli_refuses_bad_input_before_loading_the_model(no_model_loads, tmp_path, capsys, argv, message):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    assert main(["profile"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffspec: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_cli_end_to_end(tiny_model_dir, tmp_path, cache, measured, capsys):
    out = tmp_path / "out"
    argv = ["profile", "--model", str(tiny_model_dir), "--drafter", "prompt-lookup", "--max-context", "128"]
    assert main(argv + ["--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["verify"]["origin"] == "measured" and data["max_context"] == 128 and data["dtype"] == "float32"
    assert data["drafters"][0]["origin"] == "measured" and data["drafters"][0]["calibration"]["costs"]
    assert json.loads((out / "profile.json").read_text())["verify"] == data["verify"]
    assert (out / "verify_cost.png").is_file() and "wrote profile.json, verify_cost.png" in captured.err

    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "read from the cache" in text and "; cache)" in text and len(measured) == 1
    assert "ms@16" in text and "ms@32" in text and "machine: " in text and str(cache) in text
