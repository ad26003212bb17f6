"""Dtype names, device timing and the host record shared by the API, drafters, bench and training."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from .errors import DiffspecError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise DiffspecError(f"unknown dtype '{name}' (choose from: {', '.join(DTYPES)})") from None


def check_device_available(device: str) -> None:
    """Refuse, by name and before any model loads, a device torch does not know (e.g. 'tpu') or a CUDA device this
    torch cannot see."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DiffspecError(f"unknown device '{device}' (e.g. cpu, cuda, cuda:1, mps)") from None
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise DiffspecError("--device cuda asked for, but torch sees no CUDA device")


def synchronize(device) -> None:
    """Wait for queued device work, so a wall-clock reading covers it (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def host_info() -> dict:
    """CPU model and flags, threads, library versions and the git commit of this checkout."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import transformers

    here = Path(__file__).resolve().parent
    commit = ""
    try:
        git = ["git", "-C", str(here)]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if commit and subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                     text=True, timeout=10).stdout.strip():
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    commit = commit or os.environ.get("DIFFSPEC_COMMIT", "")  # a copy without .git (e.g. a GPU box) says it
    return {"cpu": model, "cpu_flags": {f: f in flags for f in CPU_FLAGS}, "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "commit": commit or None}
