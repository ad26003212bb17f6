"""In-process A/B of fused_layers.c's attention scores: "vsum" = -DATTEND_TRANSPOSED=0 (each position's score summed alone,
four positions side by side, as before), "transposed" = the default (SCORE_BLOCK positions a step, one transposing sum
vsum_lanes, bitwise vsum). Pass + logits by rows at a context of real text; variants and rows interleaved, 25 of 30
(benchmarks/build_ab.py's loop).
    python score_blocks_ab.py KERNELS [--avx2] CONTEXT [CONTEXT ...]
--avx2: both builds with -mavx2 -mfma -mf16c (what -march=native gives on Zen 1), run on this CPU."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/build_ab.py
from build_ab import pass_curve  # noqa: E402
from diffspec.packed_linear import NATIVE  # noqa: E402

args = sys.argv[1:]
kernels = args.pop(0)
flags = NATIVE
if args and args[0] == "--avx2":
    args.pop(0)
    flags = ("-mavx2", "-mfma", "-mf16c")
pass_curve(kernels, {"vsum": flags + ("-DATTEND_TRANSPOSED=0",), "transposed": flags}, [int(c) for c in args],
           label=f"{kernels} ")
