"""`train-drafter --profile-steps N`: where a training step's time goes, written where a lent GPU's run brings
its records back (issue 16: the online trainer made 75k supervised slots/s on an H200 against the 10x asked,
and the lease had no minute left to profile it).

Steps SKIP+2 .. SKIP+1+N (after SKIP steps and one warm-up step, so that allocation and autotuning are not
counted) run under torch's profiler on the main process; the loop marks its phases (`PHASES`: the batch and the
target's features, the drafter's forward with its loss, the backward pass, the optimizer step), so a table
splits a step by phase as well as by operator. Written into the run's folder as `profile_steps.txt`: operators
by device time (CUDA) and by host time, each phase's total on top. Costs the profiled steps' speed (the
profiler's own overhead), nothing after them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule

SKIP = 2
PHASES = ("diffspec: batch and target features", "diffspec: drafter forward and loss", "diffspec: backward",
          "diffspec: optimizer step")


class StepProfile:
    """Profiles `steps` training steps of a loop that calls `step()` after each of its steps and marks its phases
    with `phase(i)`; a no-op when steps is 0."""

    def __init__(self, steps: int, device, out) -> None:
        self.steps, self.path = int(steps), Path(out) / "profile_steps.txt"
        self.written = False
        self.seen = 0                # steps ended so far
        self._prof = None
        if self.steps > 0:
            cuda = torch.device(device).type == "cuda"
            self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                                 schedule=schedule(wait=SKIP, warmup=1, active=self.steps, repeat=1),
                                 on_trace_ready=self._write)
            self._cuda = cuda
            self._prof.start()

    def phase(self, i: int):
        return record_function(PHASES[i]) if self._prof is not None else contextlib.nullcontext()

    def step(self) -> None:
        self.seen += 1
        if self._prof is not None:
            self._prof.step()
            if self.written:
                self.stop()

    def stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()

    def _write(self, prof) -> None:
        """Called when the profiled steps are done, or by stop() when the run ends first: then the steps it
        saw are written, and nothing when it ended before the first profiled step."""
        active = min(self.steps, self.seen - SKIP - 1)
        if active <= 0:
            return
        events = prof.key_averages()
        parts = [f"train-drafter --profile-steps {self.steps}: steps {SKIP + 2}..{SKIP + 1 + active} "
                 f"(after {SKIP} steps and a warm-up step{'; the run ended first' if active < self.steps else ''})\n",
                 "\nms a step, by phase (host time, with what it waits for; device time on CUDA)\n"]
        # the host's entry of each phase (on CUDA a range is also listed as a GPU annotation under the same name)
        by_name = {e.key: e for e in events if e.device_type == DeviceType.CPU}
        for name in PHASES:
            e = by_name.get(name)
            if e is not None:
                device = getattr(e, "device_time_total", 0.0) if self._cuda else 0.0
                parts.append(f"  {name[len('diffspec: '):]:<36} {e.cpu_time_total / 1e3 / active:10.1f}"
                             + (f" {device / 1e3 / active:10.1f}" if self._cuda else "") + "\n")
        sorts = (["self_device_time_total"] if self._cuda else []) + ["self_cpu_time_total"]
        for by in sorts:
            parts.append(f"\n== by {by}\n")
            parts.append(events.table(sort_by=by, row_limit=30, max_name_column_width=60))
        self.path.write_text("".join(parts))
        self.written = True
