"""Drafters that choose what they compute in (`capabilities.chooses_dtype`).

`compute_dtype` is None (as loaded), a dtype name, or 'auto'. 'auto', for a drafter loaded in
float32, times one drafting step in float32 and in bfloat16 (on a copy of the model) and switches
only if bfloat16 is at least 1.2x faster: it wins where the CPU has bf16 matrix instructions and
loses where it has none; we measure instead of reading CPU flags. Other loaded dtypes are kept
(float64 is asked for exactness; a half-precision drafter is already the cheap one). The drafts
may change with the dtype; the output cannot (the target verifies every token).

A drafter using this mixin has `self.model` and implements `_use_dtype(dtype)` (convert what it
computes with and reset its caches; None: keep the model's dtype and rebuild what derives from it
as at load) and `_time_step()` (median milliseconds of one draft step).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ..devices import parse_dtype


class ChoosesDtype:
    compute_dtype: Optional[str] = None  # None: as loaded; 'auto': measured at attach; or a dtype name
    dtype_note: str = ""                 # what attach chose and why (for describe())
    _auto_model = None                   # (model, dtype) an `auto` choice settled on (kept by later attaches)

    def _use_dtype(self, dtype: Optional[torch.dtype]) -> None:
        raise NotImplementedError

    def _time_step(self) -> float:
        raise NotImplementedError

    def _settle_dtype(self) -> None:
        """Called at the end of attach: compute in `compute_dtype` (see the module docstring)."""
        request = self.compute_dtype
        loaded = next(self.model.parameters()).dtype
        settled = getattr(self, "_auto_model", None)  # (model, its dtype) an earlier auto choice left
        if request == "auto" and settled is not None and settled[0] is self.model and settled[1] == loaded:
            return  # attached again (every engine attaches; `auto`'s calibration runs two): the choice stands
        self.dtype_note, self._auto_model = "", None
        if request is None or (request == "auto" and loaded != torch.float32):
            return
        if request != "auto":
            self._use_dtype(parse_dtype(request))
            return
        fp32_ms = self._time_step()
        original = self.model
        self.model = copy.deepcopy(original)  # the trial converts a copy: the float32 weights stay untouched
        try:
            self._use_dtype(torch.bfloat16)
            bf16_ms = self._time_step()
        except (RuntimeError, NotImplementedError, TypeError) as e:  # no bf16 kernels here: float32 it is
            self.model = original
            self._use_dtype(None)
            self.dtype_note = f"float32: bfloat16 failed on this device ({type(e).__name__}: {str(e)[:80]})"
            return
        if bf16_ms * 1.2 <= fp32_ms:
            self.dtype_note = f"bfloat16: {bf16_ms:.1f} ms a draft step vs {fp32_ms:.1f} in float32"
        else:
            self.model = original
            self._use_dtype(None)
            self.dtype_note = f"float32: {fp32_ms:.1f} ms a draft step vs {bf16_ms:.1f} in bfloat16"
        self._auto_model = (self.model, next(self.model.parameters()).dtype)  # a later attach keeps it, note and all

    def _dtype_text(self) -> str:
        return self.dtype_note or str(next(self.model.parameters()).dtype).replace("torch.", "")
