"""In-process A/B (q8 target, float16 cache): "convert" = -DATTEND_HALF_SCRATCH=0 (every row of a pass converts the
float16 keys and values it reads), "scratch" = the default (a pass of several rows makes a key/value head float32
once per thread). Pass + greedy choice by rows at a context of real text; variants and rows interleaved, 25 of 30
(benchmarks/build_ab.py's loop). The scratch was not kept: on today's fused_layers.c both builds are the same code.
    python scratch_ab.py CONTEXT [CONTEXT ...]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/build_ab.py
from build_ab import pass_curve  # noqa: E402
from diffspec.packed_linear import NATIVE  # noqa: E402

pass_curve("q8", {"convert": NATIVE + ("-DATTEND_HALF_SCRATCH=0",), "scratch": NATIVE},
           [int(c) for c in sys.argv[1:]], read="greedy")
