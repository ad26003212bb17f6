"""Where measurements that belong to one machine are kept, and the keys that say whose they are.

Verify costs (costs.py), the matmul plan (kernels.py), the compile choices (compiled.py, the drafters'
compile_choice.py) and the backend choice all cache what they timed under $DIFFSPEC_CACHE/costs, keyed by
the machine (CPU model and flags, threads, torch, accelerator) and by a fingerprint of the model. This
module holds only those keys and the folder, so the modules that time something never import each other
to find them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from .devices import host_info


def cost_dir() -> Path:
    """$DIFFSPEC_COST_CACHE, else $DIFFSPEC_CACHE/costs (~/.cache/diffspec/costs)."""
    from .models import cache_root

    return Path(os.environ.get("DIFFSPEC_COST_CACHE") or cache_root() / "costs")


def reps_from_env(variable: str, default: int, what: str) -> int:
    """How many times a one-off measurement times each thing: `default`, or the integer >= 1 in $`variable`
    (the test suite sets 1: its measurements go to a cost cache of the run, never the user's)."""
    from .errors import positive_int

    raw = os.environ.get(variable)
    if raw is None:
        return default
    return positive_int(raw, f"${variable} must be an integer >= 1 ({what}), got {raw!r}")


def machine_key(device) -> dict:
    """What makes a timing belong to this machine."""
    info = _host()
    device = torch.device(device)
    accel = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {"cpu": info["cpu"], "cpu_flags": info["cpu_flags"], "cpus": info["cpus"], "threads": info["threads"],
            "torch": info["torch"], "device": device.type, "accelerator": accel}


@functools.lru_cache(maxsize=1)
def _host_cached(threads: int) -> dict:
    return host_info()


def _host() -> dict:
    return _host_cached(torch.get_num_threads())


def model_fingerprint(model: torch.nn.Module) -> str:
    """Config + parameter count + a sample of the weights: two models share it only if they compute alike."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        h.update(json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else str(cfg), sort_keys=True, default=str).encode())
    n = 0
    for name, p in model.named_parameters():
        n += p.numel()
        h.update(name.encode())
        h.update(str((tuple(p.shape), str(p.dtype))).encode())
        flat = p.detach().reshape(-1)
        h.update(flat[: 16].float().cpu().numpy().tobytes())
    h.update(str(n).encode())
    return h.hexdigest()[:16]


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
