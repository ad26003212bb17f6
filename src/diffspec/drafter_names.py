"""Drafters, chosen by a stable name (other tools read these names):

`none`, `prompt-lookup`, `block-diffusion`, `masked-diffusion`, `conditioned`, `ar:PATH`, a drafter
folder (diffspec's or a DFlash checkpoint; a hub id `owner/name` is fetched), a published layout
`fast-dllm-v2:PATH` / `dream:PATH`, or two of them joined by `+`.

This module sits above `drafters/` (the classes) and `checkpoint.py` (their weights on disk), so
neither imports the other through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import PRESETS, load_drafter, random_drafter, shipped_drafter_path
from .defaults import DRAFTER_NAMES  # noqa: F401 (the names live there, read here)
from .devices import DTYPES
from .drafters.dtype_choice import Q8
from .drafters import AutoregressiveDrafter, CombinedDrafter, Drafter, PromptLookupDrafter
from .errors import DiffspecError
from .hub import hub_folder, looks_like_hub_id

TRAINABLE_KINDS = ("block-diffusion", "masked-diffusion", "conditioned")


def weights_for(kind: str, target_name: Optional[str]) -> str:
    """Which weights `--drafter kind` would use for this target (for --list-drafters)."""
    path = shipped_drafter_path(target_name, kind)
    return f"trained weights: {path}" if path else f"random init (no trained weights for {target_name})"


def default_drafter_name(target_name: Optional[str], combine: bool = False, hidden_states: bool = True) -> str:
    """What `auto` means for a target. With `combine` (the auto policy, which switches off a part that
    loses): prompt-lookup + the shipped trained drafter (conditioned first) when one ships. Else a shipped
    drafter whose folder says measurement made it the default (`"default": true`), else prompt lookup.
    `hidden_states=False` (a backend that does not expose them, e.g. llama.cpp) leaves out the
    conditioned kind."""
    kinds = [k for k in ("conditioned", "block-diffusion", "masked-diffusion") if hidden_states or k != "conditioned"]
    if combine:
        for kind in kinds:
            if shipped_drafter_path(target_name, kind):
                return f"prompt-lookup+{kind}"
    for kind in kinds:
        path = shipped_drafter_path(target_name, kind)
        if path and json.loads((path / "config.json").read_text()).get("diffspec", {}).get("default") is True:
            return kind
    return "prompt-lookup"


def make_drafter(spec: Optional[str], target=None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", compute_dtype: Optional[str] = None, combine: bool = False) -> Optional[Drafter]:
    """A drafter from its name; None for 'none'. Diffusion names need the target (shapes, shipped weights).

    Weights load in `dtype`. `compute_dtype` ('auto' or a dtype name; None = `dtype`) is what a
    drafter with `capabilities.chooses_dtype` computes in, settled when the engine attaches it;
    naming a dtype for a drafter without that capability is refused. `combine`: `auto` may resolve to
    a combination (see default_drafter_name)."""
    check_drafter_dtype(compute_dtype)
    if spec == "auto":
        spec = default_drafter_name(target.name if target is not None else None, combine,
                                    getattr(target, "hidden_states_by_default", True))
    if spec is not None and "+" in spec:
        names = spec.split("+")
        bad = [n for n in names if n in ("", "none", "auto") or "+" in n]
        if bad:
            raise DiffspecError(f"drafter '{spec}': each part of A+B must be a drafter (not {', '.join(repr(b) for b in bad)})")
        drafter = CombinedDrafter([_make(n, target, dtype, device) for n in names])
        return set_compute_dtype(drafter, compute_dtype, spec)
    return set_compute_dtype(_make(spec, target, dtype, device), compute_dtype, spec)


def set_compute_dtype(drafter: Optional[Drafter], compute_dtype: Optional[str], spec: Optional[str]) -> Optional[Drafter]:
    """Hand `compute_dtype` to a drafter that chooses its dtype; naming a dtype for any other
    drafter (or for none) is refused. None and 'auto' pass silently where they do not apply."""
    check_drafter_dtype(compute_dtype)
    chooses = drafter is not None and drafter.capabilities.chooses_dtype
    if compute_dtype not in (None, "auto") and not chooses:
        raise DiffspecError(f"a drafter dtype ({compute_dtype}) applies to the conditioned and block-diffusion drafters; "
                            f"'{spec}' computes in the target's dtype")
    choosers = [p for p in _parts(drafter) if p.capabilities.chooses_dtype] if chooses else []
    if compute_dtype == Q8 and not (choosers and all(getattr(p, "supports_q8", False) for p in choosers)):
        raise DiffspecError(f"drafter dtype q8 (8-bit weight codes and activations) applies to the conditioned drafter; "
                            f"'{spec}' has no 8-bit pass")
    if chooses:
        drafter.compute_dtype = compute_dtype
    return drafter


def _parts(drafter: Drafter) -> list:
    return list(getattr(drafter, "parts", [drafter]))


def check_drafter_dtype(compute_dtype: Optional[str]) -> None:
    """None, 'auto' or a dtype name; anything else is refused by name before a model loads."""
    if compute_dtype is not None and compute_dtype not in ("auto", Q8) and compute_dtype not in DTYPES:
        raise DiffspecError(f"unknown drafter dtype '{compute_dtype}' (--drafter-dtype / drafter_dtype; choose from: "
                            f"auto, {Q8}, {', '.join(DTYPES)})")


def _make(spec: Optional[str], target, dtype: torch.dtype, device: str) -> Optional[Drafter]:
    if spec is None or spec == "none":
        return None
    if spec == "auto":
        spec = default_drafter_name(target.name if target is not None else None,
                                    hidden_states=getattr(target, "hidden_states_by_default", True))
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if spec in TRAINABLE_KINDS:
        if target is None:
            raise DiffspecError(f"drafter '{spec}' needs the target to be built for")
        if spec == "conditioned" and hasattr(target, "check_drafter"):
            target.check_drafter(spec, True)  # before its weights load
        shipped = shipped_drafter_path(target.name, spec)
        return load_drafter(shipped, dtype, device) if shipped else random_drafter(spec, target, dtype=dtype)
    prefix, sep, rest = spec.partition(":")
    if prefix == "ar" and sep:
        if not rest:
            raise DiffspecError("drafter 'ar:' needs a model: ar:PATH_OR_HUB_ID")
        return AutoregressiveDrafter.load(rest, dtype=dtype, device=device)
    if prefix in PRESETS and rest:
        return load_drafter(rest, dtype, device, preset=prefix)
    if Path(spec).expanduser().is_dir():
        return load_drafter(spec, dtype, device)
    if looks_like_hub_id(spec):  # e.g. a published DFlash drafter, z-lab/Qwen3-8B-DFlash-b16
        return load_drafter(hub_folder(spec), dtype, device)
    raise DiffspecError(f"unknown drafter '{spec}' (choose from: {', '.join(DRAFTER_NAMES)}; a PATH must be an "
                        f"existing folder, a hub id owner/name a drafter repository)")
