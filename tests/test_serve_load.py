"""benchmarks/serve_load.py's pure helpers on fixed numbers (no server, no model)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "serve_load", Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_load)


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert serve_load.percentile(xs, 50) == 3.0
    assert serve_load.percentile(xs, 95) == pytest.approx(4.8)
    assert serve_load.percentile(xs, 0) == 1.0 and serve_load.percentile(xs, 100) == 5.0
    assert serve_load.percentile([7.0], 95) == 7.0
    assert serve_load.percentile([], 50) is None


def _row(i, ok=True, status=200, tokens=10, lat=1.0, ttft=0.5, mal=2.0, config="auto", text="t", rounds=5):
    return {"index": i, "config": config, "concurrency": 4, "ok": ok, "status": status, "completion_tokens": tokens,
            "latency_s": lat, "ttft_s": ttft, "speculative": {"mean_accepted_length": mal, "rounds": rounds} if ok else None,
            "text": text if ok else None}


def test_summary_counts_errors_apart_from_429s_and_uses_only_ok_requests():
    rows = [_row(0, lat=1.0, ttft=0.1, mal=2.0, rounds=5), _row(1, lat=3.0, ttft=0.3, mal=3.0, rounds=15),
            _row(2, ok=False, status=429, tokens=None, lat=0.01, ttft=None),
            _row(3, ok=False, status=500, tokens=None, lat=9.0, ttft=None)]
    s = serve_load.summarize_level(rows, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"], s["http_429"]) == (4, 2, 1, 1)
    assert s["completion_tokens"] == 20 and s["throughput_tok_s"] == 5.0
    assert s["latency_p50_s"] == 2.0 and s["latency_p95_s"] == pytest.approx(2.9)
    assert s["ttft_p50_s"] == 0.2 and s["mean_accepted_length"] == 2.5
    assert s["pooled_accepted_length"] == 1.0  # 20 tokens over 20 rounds, not the mean of 2 and 3


def test_lossless_mismatches_compare_same_request_and_level_with_the_baseline():
    rows = [_row(0, config="none", text="a"), _row(1, config="none", text="b"),
            _row(0, config="auto", text="a"), _row(1, config="auto", text="B"),
            _row(2, config="auto", ok=False, status=500)]
    assert serve_load.lossless_mismatches(rows) == [("auto", 4, 1)]
