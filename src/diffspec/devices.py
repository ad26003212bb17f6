"""Dtype names and device timing shared by the API, drafters and bench."""

from __future__ import annotations

import torch

from .errors import DiffspecError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise DiffspecError(f"unknown dtype '{name}' (choose from: {', '.join(DTYPES)})") from None


def synchronize(device) -> None:
    """Wait for queued device work, so a wall-clock reading covers it (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
