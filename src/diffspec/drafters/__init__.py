"""Drafters, chosen by a stable name: `none`, `prompt-lookup`, `ar:PATH`."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import DiffspecError
from .autoregressive import AutoregressiveDrafter
from .base import Drafter, DrafterCapabilities, DraftBuilder
from .prompt_lookup import PromptLookupDrafter

DRAFTER_NAMES = {
    "none": "no drafter: plain autoregressive decoding through the same engine (the fair baseline)",
    "prompt-lookup": "n-gram copy from the prompt and the text so far (training-free)",
    "ar:PATH": "an autoregressive draft model (folder, .gguf or hub id) sharing the target's tokenizer",
}


def make_drafter(spec: Optional[str], dtype: torch.dtype = torch.float32, device: str = "cpu") -> Optional[Drafter]:
    """A drafter from its name; None for 'none'."""
    if spec is None or spec == "none":
        return None
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if spec.startswith("ar:"):
        if not spec[3:]:
            raise DiffspecError("drafter 'ar:' needs a model: ar:PATH_OR_HUB_ID")
        return AutoregressiveDrafter.load(spec[3:], dtype=dtype, device=device)
    raise DiffspecError(f"unknown drafter '{spec}' (choose from: {', '.join(DRAFTER_NAMES)})")


__all__ = ["Drafter", "DrafterCapabilities", "DraftBuilder", "PromptLookupDrafter", "AutoregressiveDrafter",
           "make_drafter", "DRAFTER_NAMES"]
