"""The measurement loop of `diffspec bench`.

Discipline: every method is built first (drafter weights loaded,
warnings recorded, not shown), then warmed up with one short generation; then for each prompt
and each repeat every method runs in turn (A B C, A B C, ...), so machine drift hits all alike.
A row per method x prompt holds the median wall time over repeats and the statistics of the
first repeat; speedup = plain's median time / the method's on the same prompt.

Lossless check: at temperature 0 every method's tokens are compared with `plain` (which always
runs); a difference is printed on stderr per prompt and makes `BenchResult.exit_code` 1. At
temperature > 0 `lossless` is None (outputs are samples; the engine's distribution tests cover it).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

import torch

from ..cache import common_prefix_length
from ..defaults import DEFAULT_BENCH_METHODS
from ..devices import host_info as machine_info
from ..errors import DiffspecError
from ..types import SamplingParams
from .methods import METHODS
from .prompts import load_bench_prompts
from .report import histogram_from_round_drafted
from .specs import build_runner, expand_methods

DEFAULT_METHODS = DEFAULT_BENCH_METHODS


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. num_prompts is per dataset (None = all); seed only matters when sampling."""

    dataset: str = "humaneval"
    num_prompts: Optional[int] = 5
    max_new_tokens: int = 128
    methods: tuple = DEFAULT_METHODS
    sweep: tuple = ()
    temperature: float = 0.0
    seed: Optional[int] = None
    repeats: int = 1
    chat: bool = True
    raster_prompt: Optional[str] = None
    quiet: bool = False
    warmup_tokens: int = 8
    command: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DiffspecError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise DiffspecError(f"--repeats must be an integer >= 1, got {self.repeats!r}")
        self.sampling()  # validates temperature and seed

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed)


@dataclass(frozen=True)
class BenchResult:
    """rows: one dict per method x prompt (stable keys, see README); methods: what each ran."""

    rows: tuple
    methods: tuple
    failures: tuple
    machine: dict
    settings: dict
    files: tuple = field(default=())

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


@contextlib.contextmanager
def quiet_libraries():
    """Silence Python warnings and transformers' logging (random-weight notes, generate hints)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where two outputs differ (one ending first counts), or None: identical."""
    n = common_prefix_length(a, b)
    return None if n == len(a) == len(b) else n


def _row(spec, runner, prompt, prompt_ids, times, outcome, base_time, plain_ids, greedy) -> dict:
    wall = _median(times)
    diff = _first_difference(outcome.token_ids, plain_ids) if greedy else None
    judged = greedy and getattr(runner, "same_model", True)  # a peer on another computation is compared, not judged
    rounds = outcome.rounds
    return {
        "method": spec.name, "base_method": spec.method, "params": dict(spec.params),
        "dataset": prompt.dataset, "prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt_ids),
        "wall_time_s": round(wall, 5), "wall_times_s": [round(t, 5) for t in times],
        "new_tokens": len(outcome.token_ids), "tokens_per_s": round(len(outcome.token_ids) / wall, 3) if wall else 0.0,
        "speedup": round(base_time / wall, 4) if wall else None,
        "mean_accepted_length": round(outcome.mean_accepted_length, 4),
        "target_forward_passes": outcome.target_forward_passes, "drafter_forward_passes": outcome.drafter_forward_passes,
        "draft_time_s": None if outcome.draft_time_s is None else round(outcome.draft_time_s, 5),
        "verify_time_s": None if outcome.verify_time_s is None else round(outcome.verify_time_s, 5),
        "prefill_time_s": None if outcome.prefill_time_s is None else round(outcome.prefill_time_s, 5),
        "rounds": len(rounds) if rounds else None,
        "drafted_tokens": sum(r[0] for r in rounds), "accepted_tokens": sum(r[1] for r in rounds),
        "round_drafted": [r[0] for r in rounds], "round_accepted": [r[1] for r in rounds],
        "round_emitted": [r[2] for r in rounds], "speculation_off_rounds": outcome.speculation_off_rounds,
        "hidden_state_rounds": outcome.hidden_state_rounds,
        "pass_round_draft_time_s": None if outcome.pass_round_draft_time_s is None
        else round(outcome.pass_round_draft_time_s, 5),
        "draft_length_histogram": histogram_from_round_drafted([r[0] for r in rounds]),
        "finish_reason": outcome.finish_reason,
        "weights": runner.weights, "policy": runner.policy, "backend": getattr(runner, "backend", "transformers"),
        "token_ids": list(outcome.token_ids), "lossless": (diff is None) if judged else None, "first_difference": diff,
    }


def prepare(config: BenchConfig, registry: Optional[dict] = None) -> tuple:
    """(prompts, method specs), checked before any model loads: bad input fails in milliseconds."""
    specs = expand_methods(config.methods, config.sweep, registry)
    prompts = load_bench_prompts(config.dataset, config.num_prompts)
    if config.raster_prompt is not None and config.raster_prompt not in {p.prompt_id for p in prompts}:
        raise DiffspecError(f"--raster-prompt '{config.raster_prompt}' is not among the selected prompts "
                            f"(e.g. '{prompts[0].prompt_id}')")
    return prompts, specs


def run_bench(config: BenchConfig, target, registry: Optional[dict] = None, out: Optional[str] = None,
              stderr: Optional[TextIO] = None) -> BenchResult:
    """Measure every method of `config` on `target` (a diffspec Target); write outputs to `out`."""
    from .report import write_outputs

    registry = METHODS if registry is None else registry
    stderr = sys.stderr if stderr is None else stderr
    prompts, specs = prepare(config, registry)
    sampling = config.sampling()
    encoded = []
    for p in prompts:
        ids = target.encode_prompt(p.text, chat=config.chat)
        if len(ids) >= target.max_context:
            raise DiffspecError(f"prompt {p.dataset}/{p.prompt_id} has {len(ids)} tokens, more than fits in the "
                                f"target's context of {target.max_context}")
        encoded.append(ids)

    methods, runners = [], {}
    for spec in specs:
        runner, notes = build_runner(spec, target, registry)
        runners[spec.name] = runner
        methods.append({"name": spec.name, "method": spec.method, "params": dict(spec.params),
                        "weights": runner.weights, "policy": runner.policy,
                        "backend": getattr(runner, "backend", "transformers"), "notes": list(notes)})

    rows, failures = [], []
    partial = None
    if out is not None:  # rows are appended as they come, so a killed long run keeps what it measured
        Path(out).mkdir(parents=True, exist_ok=True)
        partial = open(Path(out) / "results.partial.jsonl", "w")
    from ..progress import progress_bar

    progress = progress_bar(len(prompts) * config.repeats * len(specs), None, unit="run", enabled=not config.quiet,
                            file=stderr)
    with quiet_libraries():
        for spec in specs:  # warm-up: one short generation per method
            runners[spec.name].run(encoded[0], min(config.warmup_tokens, config.max_new_tokens), sampling)
        for prompt, ids in zip(prompts, encoded):
            times = {s.name: [] for s in specs}
            outcomes = {}
            for _ in range(config.repeats):
                for spec in specs:
                    progress.set_postfix_str(f"{prompt.dataset}/{prompt.prompt_id} {spec.name}"[:60])
                    outcome = runners[spec.name].run(ids, config.max_new_tokens, sampling)
                    progress.update()
                    times[spec.name].append(outcome.wall_time_s)
                    outcomes.setdefault(spec.name, outcome)
            base = _median(times["plain"])
            plain_ids = outcomes["plain"].token_ids
            for spec in specs:
                row = _row(spec, runners[spec.name], prompt, ids, times[spec.name], outcomes[spec.name], base,
                           plain_ids, sampling.greedy)
                rows.append(row)
                if partial is not None:
                    partial.write(json.dumps(row) + "\n")
                    partial.flush()
                if row["lossless"] is False:
                    i = row["first_difference"]
                    mine, theirs = row["token_ids"][i: i + 1], list(plain_ids[i: i + 1])
                    failures.append(f"{spec.name} differs from plain on {prompt.dataset}/{prompt.prompt_id} "
                                    f"at new token {i}: {mine or 'end'} vs plain {theirs or 'end'}")
                    progress.write(f"diffspec: LOSSLESS FAILURE: {failures[-1]}", file=stderr)
    progress.close()
    if partial is not None:
        partial.close()

    settings = {"dataset": config.dataset, "num_prompts": config.num_prompts, "prompts": len(prompts),
                "max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "seed": config.seed,
                "repeats": config.repeats, "chat": config.chat, "methods": [s.name for s in specs],
                "sweep": list(config.sweep), "target": getattr(target, "name", None),
                "target_dtype": str(getattr(target, "dtype", "")).replace("torch.", ""),
                "target_backend": getattr(target, "backend", "transformers"),
                "target_runtime": target.runtime() if hasattr(target, "runtime") else None,
                "command": config.command or shlex.join(["diffspec", "bench"])}
    machine = machine_info()
    if getattr(target, "device", torch.device("cpu")).type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(target.device)
    result = BenchResult(tuple(rows), tuple(methods), tuple(failures), machine, settings)
    if out is not None:
        files = write_outputs(result, out, config.raster_prompt, stderr=stderr)
        (Path(out) / "results.partial.jsonl").unlink(missing_ok=True)  # complete: results.jsonl has every row
        result = BenchResult(result.rows, result.methods, result.failures, result.machine, result.settings, files)
    return result
