"""Drafters that choose what they compute in (`capabilities.chooses_dtype`).

`compute_dtype` is None (as loaded), a dtype name, 'q8', or 'auto'. 'auto', for a drafter loaded in
float32, times one drafting step in float32, in bfloat16 (on a copy of the model) and, for a drafter with
`supports_q8` on a CPU where its kernel builds, in 8-bit arithmetic ('q8': Q8_0 weight codes and 8-bit
activations, conditioned_fused.py). It switches from float32 only to an arithmetic at least 1.2x faster,
and from bfloat16 to q8 likewise: bf16 wins where the CPU has bf16 matrix instructions and loses where it
has none, q8 wins where float products are slow; we measure instead of reading CPU flags. Other loaded
dtypes are kept (float64 is asked for exactness; a half-precision drafter is already the cheap one). The
drafts may change with the arithmetic; the output cannot (the target verifies every token).

A drafter using this mixin has `self.model` and implements `_use_dtype(dtype)` (convert what it
computes with and reset its caches; None: keep the model's dtype and rebuild what derives from it
as at load; Q8: a float32 model computed in 8-bit arithmetic) and `_time_step()` (median milliseconds of
one draft step); `_q8_unavailable()` says why q8 cannot run here (None: it can).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ..devices import parse_dtype
from ..errors import DiffspecError


Q8 = "q8"  # compute_dtype's name for 8-bit arithmetic (Q8_0 weight codes, 8-bit activations)


class ChoosesDtype:
    compute_dtype: Optional[str] = None  # None: as loaded; 'auto': measured at attach; 'q8'; or a dtype name
    dtype_note: str = ""                 # what attach chose and why (for describe())
    _auto_model = None                   # (model, dtype) an `auto` choice settled on (kept by later attaches)
    supports_q8: bool = False            # whether `_use_dtype(Q8)` exists (the conditioned drafter)

    def _q8_unavailable(self) -> Optional[str]:
        """Why this drafter cannot compute in q8 here (None: it can)."""
        return None if self.supports_q8 else f"{type(self).__name__} has no 8-bit pass"

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
        if self.computes_q8:  # an earlier attach's q8: every choice below starts from the float model
            self._use_dtype(None)
        if request is None or (request == "auto" and loaded != torch.float32):
            return
        if request == Q8:
            reason = self._q8_unavailable()
            if reason:
                raise DiffspecError(f"drafter dtype q8: {reason}")
            if loaded != torch.float32:  # the codes are quantized from float32 weights
                self.model = self.model.float()
            self._use_dtype(Q8)
            return
        if request != "auto":
            self._use_dtype(parse_dtype(request))
            return
        times = {"float32": self._time_step()}
        original, trial = self.model, copy.deepcopy(self.model)  # bf16's trial converts a copy: float32 stays
        failed = []
        try:
            self.model = trial
            self._use_dtype(torch.bfloat16)
            times["bfloat16"] = self._time_step()
        except (RuntimeError, NotImplementedError, TypeError) as e:  # no bf16 kernels here
            failed.append(f"bfloat16 failed on this device ({type(e).__name__}: {str(e)[:80]})")
        if self._q8_unavailable() is None:
            self.model = original
            try:
                self._use_dtype(Q8)
                times[Q8] = self._time_step()
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                failed.append(f"q8 failed here ({type(e).__name__}: {str(e)[:80]})")
        choice = "float32"
        for name in ("bfloat16", Q8):  # a switch must buy 1.2x over what it replaces
            if name in times and times[name] * 1.2 <= times[choice]:
                choice = name
        self.model = trial if choice == "bfloat16" else original
        self._use_dtype({"float32": None, "bfloat16": torch.bfloat16, Q8: Q8}[choice])
        others = [f"{ms:.1f} in {name}" for name, ms in times.items() if name != choice]
        self.dtype_note = f"{choice}: {times[choice]:.1f} ms a draft step" + \
            (f" vs {', '.join(others)}" if others else "") + "".join(f"; {f}" for f in failed)
        self._auto_model = (self.model, next(self.model.parameters()).dtype)  # a later attach keeps it, note and all

    @property
    def computes_q8(self) -> bool:
        """Whether this drafter drafts in 8-bit arithmetic now."""
        return False

    def _dtype_text(self) -> str:
        return self.dtype_note or (Q8 if self.computes_q8 else str(next(self.model.parameters()).dtype).replace("torch.", ""))
