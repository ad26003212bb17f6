"""Does another quantisation flatten llama.cpp's verify curve? (issue 18: why speculation does not pay
on the llama.cpp backend). The shipped GGUF (Q4_1) is requantised by llama.cpp itself
(`llama_model_quantize`, allow_requantize: the values are Q4_1's, re-rounded; only the kernels
matter here) to Q8_0, Q4_0 and F16 in a temporary folder; each file's pass of 1 + k tokens after 256
is timed (three turns over the files, min of medians), and its parity probe run.

    python benchmarks/llama_cpp_quant_curve.py OUT.json
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from diffspec.backends.llama_cpp import LlamaCppTarget, import_llama_cpp
from diffspec.models import gguf_file

KS = (0, 1, 2, 4, 8, 16, 32)


def requantise(src: str, out: str, ftype: int) -> None:
    lib = import_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # it lists every tensor
    try:
        rc = lib.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    finally:
        os.dup2(stderr, 2)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc}) for {out}")


def main() -> None:
    lib = import_llama_cpp()
    src = str(gguf_file(None))
    tmp = tempfile.mkdtemp(prefix="quant-curve-")
    files = {"q4_1 (shipped)": src}
    for name, ftype in (("q8_0", lib.LLAMA_FTYPE_MOSTLY_Q8_0), ("q4_0", lib.LLAMA_FTYPE_MOSTLY_Q4_0),
                        ("f16", lib.LLAMA_FTYPE_MOSTLY_F16)):
        files[name] = os.path.join(tmp, f"smollm2-{name}.gguf")
        requantise(src, files[name], ftype)
    targets = {n: LlamaCppTarget.load(p, quiet=True) for n, p in files.items()}
    ids = torch.randint(0, 49000, (256 + max(KS) + 1,), generator=torch.Generator().manual_seed(0))
    best = {n: {k: float("inf") for k in KS} for n in files}
    for _ in range(3):
        for n, t in targets.items():
            t.reset()
            t.forward(ids[:256], logits=False)
            for k in KS:
                times = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    t.forward(ids[256: 257 + k])
                    times.append(time.perf_counter() - t0)
                    t.truncate(256)
                best[n][k] = min(best[n][k], statistics.median(times[1:]) * 1e3)
            t.reset()
    out = {}
    for n, t in targets.items():
        rec = t.parity_probe()
        row = best[n]
        out[n] = {"ms": {k: round(row[k], 2) for k in KS},
                  "x_step": {k: round(row[k] / row[0], 2) for k in KS},
                  "parity_exact": rec["exact"], "first_mismatch": rec["first_mismatch"]}
        print(f"{n:15}", " ".join(f"k{k}:{row[k]:7.2f}" for k in KS), "| exact:", rec["exact"])
    with open(sys.argv[1], "w") as f:
        json.dump({"context": 256, "threads": next(iter(targets.values())).threads, "files": out}, f, indent=1)


if __name__ == "__main__":
    main()
