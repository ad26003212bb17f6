"""`diffspec profile`: what a round costs on this machine, as the auto policy sees it.

    diffspec profile [--model M] [--drafter D] [--dtype float32] [--max-context N] [--recalibrate]
                     [--out DIR] [--json]

Reads (or measures and caches, see costs.py) the target's verify cost table: seconds of one verify
pass over k drafted tokens at a few context lengths. With `--drafter`, each part of the drafter
(both of `A+B`) gets its calibration record from the cache, or a short calibration run (the one the
auto policy makes at start), and the fitted draft cost: fixed seconds a round + seconds a drafted
token. Prints the table, the drafters' costs, where each came from, the cache files and the machine
key; `--out DIR` writes profile.json and verify_cost.png; `--json` prints profile.json's object.

    from diffspec.profile import profile_target, write_profile
    profile = profile_target(target, drafter="prompt-lookup")
    print(profile.table())
    write_profile(profile, "runs/profile")
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .costs import VERIFY_KS, CostTable
from .errors import DiffspecError
from .output import pyplot_or_warn, write_atomically

MIN_CONTEXT = max(VERIFY_KS) + 2  # a context token, then the largest verify block: below this nothing is timed


@dataclass(frozen=True)
class DrafterProfile:
    """One drafter (one part of `A+B`): its fitted cost and the calibration record it came from."""

    name: str
    description: str            # the drafter's describe(), part of its cache key
    origin: str                 # 'cache' or 'measured'
    cache_file: str
    fixed_s: float              # seconds a drafting round costs whatever it drafts
    per_token_s: float          # seconds a drafted token adds
    record: dict                # the calibration record: costs [[k, s]..], acceptance counts, gammas, new_tokens

    @property
    def rounds(self) -> int:
        return len(self.record.get("costs", []))

    @property
    def first_acceptance(self) -> Optional[float]:
        """Share of calibration rounds whose first drafted token was accepted (None: none judged)."""
        acc = self.record.get("acceptance") or {}
        judged = (acc.get("pos_judged") or [0.0])[0]
        return (acc.get("pos_accepted") or [0.0])[0] / judged if judged else None

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "origin": self.origin,
                "cache_file": self.cache_file, "fixed_s": self.fixed_s, "per_token_s": self.per_token_s,
                "rounds": self.rounds, "first_acceptance": self.first_acceptance, "calibration": self.record}


@dataclass(frozen=True)
class Profile:
    """The verify cost table of one target on this machine, and the draft costs of its drafters."""

    target: str
    dtype: str
    device: str
    max_context: int
    costs: CostTable
    origin: str                 # 'cache' or 'measured'
    cache_file: str
    machine: dict               # the machine key the table is filed under (costs.machine_key)
    drafters: tuple = ()        # DrafterProfile per part
    backend: str = "transformers"  # what ran the target (backends/)
    runtime: Optional[dict] = None   # transformers: its matmul kernels and compiled passes (Target.runtime)

    @property
    def from_cache(self) -> bool:
        return self.origin == "cache"

    def to_dict(self) -> dict:
        return {"target": self.target, "backend": self.backend, "runtime": self.runtime, "dtype": self.dtype,
                "device": self.device,
                "max_context": self.max_context, "machine": self.machine,
                "verify": {"origin": self.origin, "cache_file": self.cache_file, **self.costs.to_json()},
                "drafters": [d.to_dict() for d in self.drafters]}

    def table(self) -> str:
        """Plain text: verify ms per k and context, its ratio to k = 0, the drafters, the cache, the machine."""
        t = self.costs
        ms = [f"ms@{c}" for c in t.contexts]
        ratio = [f"x@{c}" for c in t.contexts]
        width = max(8, max(len(h) for h in ms + ratio) + 1)
        lines = [f"target {self.target} ({self.backend}, {self.dtype}, {self.device}, max context {self.max_context})"]
        if self.runtime:
            lines.append(f"passes: {self.runtime['compile']['runs']}; matmuls: {self.runtime['linear_plan']}")
        lines += [f"verify cost of one pass over k drafted tokens ({'read from the cache' if self.from_cache else 'measured now'}):",
                  f"{'k':>4s} |" + "".join(f"{h:>{width}s}" for h in ms) + " |" +
                  "".join(f"{h:>{width}s}" for h in ratio)]
        for i, k in enumerate(t.ks):
            row = [r[i] * 1e3 for r in t.verify_s]
            x = [r[i] / r[0] if r[0] > 0 else float("nan") for r in t.verify_s]
            lines.append(f"{k:4d} |" + "".join(f"{v:{width}.3f}" for v in row) + " |" +
                         "".join(f"{v:{width}.2f}" for v in x))
        if self.drafters:
            lines.append("draft cost (fitted to a calibration run: fixed + per drafted token):")
            for d in self.drafters:
                acc = "" if d.first_acceptance is None else f", first draft accepted {d.first_acceptance:.0%}"
                lines.append(f"  {d.description}: {d.fixed_s * 1e3:.3f} ms a round + {d.per_token_s * 1e3:.3f} ms a "
                             f"drafted token ({d.rounds} rounds{acc}; {d.origin})")
        lines.append("cache files:")
        lines.append(f"  verify: {self.cache_file}")
        lines.extend(f"  {d.name}: {d.cache_file}" for d in self.drafters)
        lines.append("machine: " + format_machine(self.machine))
        return "\n".join(lines)


def format_machine(m: dict) -> str:
    flags = " ".join(f for f, on in (m.get("cpu_flags") or {}).items() if on) or "none of avx2/avx512"
    accel = f", {m['accelerator']}" if m.get("accelerator") else ""
    return (f"{m.get('cpu')} | flags {flags} | {m.get('cpus')} cpus, {m.get('threads')} torch threads | "
            f"torch {m.get('torch')} | device {m.get('device')}{accel}")


# --- checks before anything loads --------------------------------------------------------------
def check_profile_args(dtype: str = "float32", max_context: Optional[int] = None, out=None,
                       drafter: Optional[str] = None, drafter_dtype: Optional[str] = "auto") -> None:
    """Refuse bad arguments by name (the CLI calls this before the model loads)."""
    from .devices import parse_dtype
    from .drafter_names import check_drafter_dtype

    parse_dtype(dtype)
    check_drafter_dtype(drafter_dtype)
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < MIN_CONTEXT):
        raise DiffspecError(f"--max-context must be an integer >= {MIN_CONTEXT} (a context token plus the "
                            f"{max(VERIFY_KS)}-token verify block timed), got {max_context!r}")
    if out is not None:
        out = Path(out).expanduser()
        from .cli_options import check_out_folder

        check_out_folder(out)
    if drafter is not None:
        from .cli_options import check_drafter_spec

        check_drafter_spec(drafter)


# --- the work ----------------------------------------------------------------------------------
def profile_drafter(target, part, recalibrate: bool = False, progress: bool = False) -> DrafterProfile:
    """One drafter's calibration record: from the cache, else a calibration run (written to the cache)."""
    from .costs import drafter_calibration, fit_draft_cost
    from .engine import SpeculativeEngine
    from .policies import auto

    part.attach(target)  # before its key: attaching settles what it computes in
    measure = (lambda: auto.calibrate_drafter(target, part, engine_type=SpeculativeEngine))
    record, origin, path = drafter_calibration(target, part, measure, recalibrate=recalibrate, progress=progress)
    record = {k: v for k, v in record.items() if k not in ("format", "key", "drafter")}
    cost = fit_draft_cost(record.get("costs", []))
    return DrafterProfile(name=part.name, description=part.describe(), origin=origin,
                          cache_file=str(path), fixed_s=cost.fixed_s,
                          per_token_s=cost.per_token_s, record=record)


def profile_target(target, drafter=None, recalibrate: bool = False, progress: bool = False,
                   drafter_dtype: Optional[str] = None) -> Profile:
    """The verify cost table of `target` (cached or measured) and, with `drafter` (a name make_drafter
    accepts, or a Drafter), each of its parts' draft cost. `recalibrate`: measure everything again."""
    from .costs import load_or_measure_verify_costs, machine_key, verify_path

    if target.max_context < MIN_CONTEXT:
        raise DiffspecError(f"the context of {target.name} is {target.max_context} tokens: timing verify passes of up "
                            f"to {max(VERIFY_KS)} tokens needs at least {MIN_CONTEXT}")
    if isinstance(drafter, str):
        from .cli_options import check_drafter_spec

        check_drafter_spec(drafter)
        from .drafter_names import make_drafter

        drafter = make_drafter(drafter, target, dtype=target.dtype, device=str(target.device),
                               compute_dtype=drafter_dtype, combine=True)
    costs, from_cache = load_or_measure_verify_costs(target, recalibrate=recalibrate, progress=progress)
    parts = () if drafter is None else drafter.parts
    drafters = tuple(profile_drafter(target, p, recalibrate=recalibrate, progress=progress) for p in parts)
    return Profile(target=target.name, dtype=str(target.dtype).replace("torch.", ""), device=str(target.device),
                   max_context=target.max_context, costs=costs, origin="cache" if from_cache else "measured",
                   cache_file=str(verify_path(target)), machine=machine_key(target.device), drafters=drafters,
                   backend=target.backend, runtime=target.runtime() if hasattr(target, "runtime") else None)


# --- output ------------------------------------------------------------------------------------
def write_profile(profile: Profile, out_dir) -> list:
    """Write profile.json and verify_cost.png (skipped with a warning without matplotlib) -> the paths."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.json"
    write_atomically(path, json.dumps(profile.to_dict(), indent=1) + "\n")
    written = [path]
    png = plot_verify_cost(profile, out / "verify_cost.png")
    if png is not None:
        written.append(png)
    return written


def plot_verify_cost(profile: Profile, path) -> Optional[Path]:
    """Verify ms vs k, one line per context length."""
    plt = pyplot_or_warn("verify_cost.png")
    if plt is None:
        return None

    t = profile.costs
    fig, ax = plt.subplots(figsize=(7, 4.2))
    try:
        for c, row in zip(t.contexts, t.verify_s):
            ax.plot(t.ks, [s * 1e3 for s in row], marker="o", label=f"context {c}")
        ax.set_xlabel("drafted tokens verified k (k = 0: a plain step)")
        ax.set_ylabel("verify pass (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        cpu = str(profile.machine.get("cpu", ""))
        ax.set_title(f"{profile.target} ({profile.dtype}, {profile.device}): verify cost\n{cpu}, "
                     f"{profile.machine.get('threads')} threads", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


def profile_command(args) -> int:
    """`diffspec profile` (cli.py parses the arguments)."""
    from .backends import check_backend_settings, load_target
    from .devices import check_device_available, parse_dtype

    check_profile_args(args.dtype, args.max_context, args.out, args.drafter, args.drafter_dtype)
    device = getattr(args, "device", "cpu")
    check_device_available(device)
    check_backend_settings(args.backend, args.model, parse_dtype(args.dtype), device, args.kernels, args.compile)
    target = load_target(args.model, backend=args.backend, dtype=parse_dtype(args.dtype), device=device,
                         max_context=args.max_context, quiet=args.json, drafters=(args.drafter,), kernels=args.kernels,
                         compile=args.compile)
    profile = profile_target(target, args.drafter, recalibrate=args.recalibrate, progress=not args.json,
                             drafter_dtype=args.drafter_dtype)
    if args.out is not None:
        written = write_profile(profile, args.out)
        print(f"wrote {', '.join(p.name for p in written)} to {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(profile.to_dict()))
    else:
        print(profile.table())
    return 0
