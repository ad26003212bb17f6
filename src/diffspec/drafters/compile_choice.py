"""Drafters whose own passes run compiled (`capabilities.compiles_passes`; issue 19 item 3).

A drafter follows the target's `--compile` mode (compiled.py; the transformers backend's setting,
`off` on any other backend):

- `off`: eager.
- `on`: the drafter's steady-state pass is compiled when the engine attaches it (the compile time
  is reported in describe()), so no request stalls on it.
- `auto`: the same pass is compiled at attach and timed against eager (interleaved, min over turns of
  the medians); the compiled pass is kept where it is at least 1/AUTO_MARGIN faster. The decision is
  cached per machine, drafter weights, dtype and torch version: where eager won, later starts skip
  the compile.

What is compiled is one module's forward (`_compile_module()`: a drafter's body, never its output
head, which stays eager and applies to the rows read only), and any other function of the step the
drafter names (`_compile_extra_parts()`), each `torch.compile(dynamic=True)`: the context
length is symbolic, so a request's growing context reuses one graph. A drafter runs a pass compiled only
in its steady-state shape (`_compiled_body(eligible)`: e.g. a block of its block size on a non-empty
cache); other passes (the first commit of a prompt) run the same module eagerly, on the same weights
and cache. The graph belongs to the model and dtype it was compiled for: a drafter whose model is
swapped (the dtype trial's copy) or converted runs eagerly until attached again. Compiling happens on
two context lengths, so the graph is general in the length before any request runs (torch gives sizes
that happen to be equal at trace time one symbol). A compile that fails (no C compiler, a model dynamo
cannot trace) leaves the drafter eager, with the reason in describe() and a warning.

Exactness: a compiled pass sums in other (fused) kernels, so a draft may differ from eager's at a
near-tie; the output cannot (the target verifies every token, and q is the row the draft was drawn
from, compiled or not).

A drafter using this mixin has `self.model` and implements `_compile_module()`, `_time_step(repeats=...)` (median ms of one
steady-state draft step; the dtype choice uses the same) and may override `_compile_refusal()` (a reason
its passes cannot run compiled, or None).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Optional

import torch

from ..compiled import AUTO_MARGIN  # auto keeps the compiled pass where it timed at least this much faster

FORMAT = 1


class CompilesPasses:
    compile_mode: str = "off"        # the target's mode, read at attach
    compile_note: str = ""           # what attach chose and why (for describe())
    compile_record: dict = {}        # compile seconds and auto's timings (describe() says the gist)
    _compiled_fn = None              # torch.compile(module.forward), or None
    _compiled_extras: dict = {}      # name -> torch.compile(fn) of _compile_extra_parts()
    _compiled_active: bool = False   # False: eager (auto's trial, the dtype trial)
    _settled_for = None              # (model, dtype, signature) the last decision (and graph) was made for

    def _compile_module(self) -> torch.nn.Module:
        raise NotImplementedError

    def _compile_extra_parts(self) -> dict:
        """Other functions of the drafter's steady-state step to compile with the body (name -> function;
        `_compiled_part(name)` hands them out under the same rules), e.g. the conditioned drafter's
        context keys and values. The warm-up (`_time_step` on the compile contexts) must run each in
        every shape a request will (a size of 1 is its own graph)."""
        return {}

    def _compile_refusal(self) -> Optional[str]:
        return None

    def _compile_signature(self) -> str:
        """What else changes a step's cost (shape settings, kernels): part of auto's cache key."""
        return ""

    def _compile_contexts(self) -> tuple:
        """The two context lengths the pass is compiled on: distinct, and neither equal to another size of
        the pass (see the module docstring)."""
        return 48, 112

    def _compiled_body(self, eligible: bool = True):
        """The compiled forward to run this pass with, or None: eager."""
        return self._valid(self._compiled_fn, eligible)

    def _compiled_part(self, name: str, eligible: bool = True):
        """The compiled `_compile_extra_parts()[name]`, or None: eager."""
        return self._valid(self._compiled_extras.get(name), eligible)

    def _valid(self, fn, eligible: bool):
        if not (eligible and self._compiled_active and fn is not None):
            return None
        model, dtype, _ = self._settled_for
        return fn if self.model is model and next(model.parameters()).dtype == dtype else None

    @property
    def runs_compiled(self) -> bool:
        """Whether this drafter's steady-state passes run compiled now."""
        return self._compiled_body() is not None

    @contextmanager
    def _eager(self):
        """Run every pass eagerly inside (the dtype trial: both dtypes timed alike)."""
        active, self._compiled_active = self._compiled_active, False
        try:
            yield
        finally:
            self._compiled_active = active

    def _settle_compile(self, target) -> None:
        """Called at the end of attach: follow the target's mode (off for a backend without one)."""
        compiled = getattr(target, "compiled", None)
        self.compile_passes(getattr(compiled, "mode", "off"), quiet=getattr(compiled, "quiet", True))

    def compile_passes(self, mode: str, quiet: bool = True) -> None:
        """Run this drafter's passes compiled per `mode` (off, on, auto; see the module docstring). The
        engine calls it at attach with the target's mode; a benchmark may call it directly. Not quiet:
        what was chosen is said on stderr, as the target's compiles are."""
        from ..compiled import allow_graphs, check_compile

        check_compile(mode)
        settled_for = (self.model, next(self.model.parameters()).dtype, self._compile_signature())
        if mode == self.compile_mode and (mode == "off" or self._settled_for == settled_for):
            return  # attached again (the auto policy's calibration) to the same model, dtype and settings
        self._settled_for = settled_for
        self.compile_mode, self.compile_note, self.compile_record = mode, "", {}
        self._compiled_fn, self._compiled_extras, self._compiled_active = None, {}, False
        if mode == "off":
            return
        refusal = self._compile_refusal()
        if refusal:
            self.compile_note = f"eager: {refusal}"
            self._say(quiet)
            return
        cached = self._cached_decision() if mode == "auto" else None
        if cached is not None and cached.get("keep") is False:
            self.compile_record = {**cached, "origin": "cache"}
            self.compile_note = "eager: compiled measured slower (cached)"
            self._say(quiet)
            return
        started = time.perf_counter()
        try:  # compiles, on two context lengths (see the module docstring)
            allow_graphs(8)
            self._compiled_fn = torch.compile(self._compile_module().forward, dynamic=True)
            self._compiled_extras = {name: torch.compile(fn, dynamic=True)
                                     for name, fn in self._compile_extra_parts().items()}
            self._compiled_active = True
            for context in self._compile_contexts():
                self._time_step(context_len=context, repeats=1)
        except Exception as e:  # inductor's or dynamo's own errors: eager it is, said
            self._compiled_fn, self._compiled_extras, self._compiled_active = None, {}, False
            self.compile_note = f"eager: compiling failed ({type(e).__name__}: {str(e)[:120]})"
            warnings.warn(f"diffspec: drafter {getattr(self, 'name', '')}: {self.compile_note}", stacklevel=2)
            return
        compile_s = round(time.perf_counter() - started, 1)
        self.compile_record = {"compile_s": compile_s}
        if mode == "on":
            self.compile_note = f"compiled, {compile_s:.0f} s to compile"
            self._say(quiet)
            return
        eager, compiled = [], []
        for _ in range(3):
            self._compiled_active = False
            eager.append(self._time_step())
            self._compiled_active = True
            compiled.append(self._time_step())
        eager_ms, compiled_ms = min(eager), min(compiled)
        keep = compiled_ms < AUTO_MARGIN * eager_ms
        self._compiled_active = keep
        self.compile_record = {"format": FORMAT, "keep": keep, "eager_ms": round(eager_ms, 2),
                               "compiled_ms": round(compiled_ms, 2), "compile_s": compile_s, "origin": "measured"}
        self.compile_note = (f"{'compiled' if keep else 'eager'} (auto: {compiled_ms:.1f} ms a step compiled, "
                             f"{eager_ms:.1f} eager)")
        self._write_decision(self.compile_record)
        self._say(quiet)

    def _say(self, quiet: bool) -> None:
        if not quiet:
            print(f"diffspec: drafter {getattr(self, 'name', '')}: {self.compile_note}", file=sys.stderr, flush=True)

    def _decision_path(self):
        from ..machine_keys import cache_key, cost_dir, machine_key, model_fingerprint

        module = self._compile_module()
        device = next(module.parameters()).device
        key = cache_key("drafter-compile-auto", FORMAT, type(self).__name__, machine_key(device),
                        model_fingerprint(module), self._compile_signature(), torch.__version__, AUTO_MARGIN)
        return cost_dir() / f"drafter-compile-auto-{key}.json"

    def _cached_decision(self) -> Optional[dict]:
        try:
            cached = json.loads(self._decision_path().read_text())
        except (OSError, ValueError):
            return None
        return cached if isinstance(cached, dict) and cached.get("format") == FORMAT else None

    def _write_decision(self, record: dict) -> None:
        from ..output import try_write_cache

        try_write_cache(self._decision_path(), json.dumps(record), "the drafter's compile decision")

    def _compile_text(self) -> str:
        return "" if self.compile_mode == "off" else f", {self.compile_note}"
