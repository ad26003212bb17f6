"""`auto`: each round, the draft length that maximises expected tokens per expected second, k = 0
(a plain step) included, from measured costs (costs.py) and acceptance learnt online (acceptance.py).

Per round, three decisions, all pure functions of the cost table and the estimates (choice.py):

1. run or not (`plan_round`): each drafter ("source") keeps two decayed records of what its rounds
   gave, in plain steps: efficiency = sum(emitted) / sum(round seconds / plain-step seconds), one over
   its last few rounds (`decay`), one over its last ~50 runs (`LONG_DECAY`), runs that found nothing
   included. A source runs while its short record is at least 1 - `tolerance`. Where step 3 may cut
   its drafts (greedy, or a drafter whose drafts are verified as one-hot q at any temperature: prompt
   lookup), it also runs while running it every round has paid lately (long record >= 1, for a source
   whose run costs under `LONG_RUN_SHARE` of a plain step), or while a steady run of it (found a draft
   or not, in a round after one it ran in: its `look_cost`) costs less than `cheap_share` of a plain
   step. Step 3 cuts every draft that would not pay, so such a source loses only its runs' cost and
   catches every copy: judged by its short record it would be switched off after a few rounds without
   a copy, each costing 1-3% of a step, and miss the copies that follow, though one accepted copy of 4
   tokens pays for ~100 runs that find nothing. Otherwise it is off, and probed again after 4, 8, 16 ..
   64 plain rounds (the gap doubles while probes keep losing). A probe's run also catches up on what
   the source missed (prompt lookup indexes every token since its last run), so it does not time
   a run; where the source might be cheap (its steady runs under `FOLLOW_UP` x the limit) the probe runs two
   rounds, and the second does. Nothing runs -> a plain step, with no drafter time at all.
2. how far to draft (`next_increment`): the length that maximises the expected rate with the
   estimates at hand - by confidence for tokens drafted, by position beyond - and the drafter's
   own cost (fixed + per token, fitted to its measured draft times). A drafter whose extra tokens
   cost nothing (a block drafter) drafts its whole block when greedy; the cut comes in step 3.
3. how many drafted tokens to verify (`final_length`, only where the choice cannot bias the output:
   greedy, or a draft that is a deterministic function of the context, e.g. prompt lookup): the k
   in 0..drafted that maximises expected emitted / (seconds already spent drafting + verify(k)).

With two drafters (`lookup+conditioned`), the cheap one runs first, and the other only when its
record promises more than the cheap one's draft; the proposal with the larger expected value wins.

A drafter that reads the target's hidden states costs rounds in which it does not run: every verify pass
returns them for it, and a probe first catches up the features of the positions it skipped. So such a
source whose probes keep losing is *retired*: once it is off and its probe gap has reached `probe_max`,
it stops for the rest of the request, the engine stops asking the target for hidden states
(`wants_hidden_states`), and it sits out the next 1, 2, 4 .. `sit_out_max` requests (the gap doubles
each time it is retired again, and starts over at 1 once it pays). A request in which it is live starts
its probes at `probe_first` again, and while it has not paid since it was retired (or since its
calibration said it loses here), its first lost probe retires it (a live request then costs
~`probe_first` rounds of hidden states, not the ~2 x `probe_max` a first request's schedule takes).
`retire_readers=False` keeps it reading every round.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from ..costs import CostTable, DraftCost, fit_draft_cost
from ..errors import DiffspecError
from .acceptance import AcceptanceCounts, AcceptanceModel
from .base import LengthPolicy
from .choice import best_length, best_rate, round_rates


FOLLOW_UP = 2.0  # a probe runs two rounds where the source's run was timed under this many times the cheap limit
LONG_DECAY = 0.98  # the long record's decay per run (~50 runs)
LONG_LEAST = 8.0   # the long record speaks once it holds this many plain steps (no prior: it is evidence only)
LONG_RUN_SHARE = 0.1  # ... and only for a source whose run costs under this share of a plain step: a costlier one
# (a diffusion drafter's pass) must answer to its short record, or it would run ~35 rounds past its last payday
CALIBRATION_JUDGED = 16  # a calibration record sets the prior only where it judged at least this many drafted tokens
CALIBRATION_CONTEXT = 256  # the context at which a calibration record is valued


class _Source:
    """What the policy knows of one drafter."""

    def __init__(self, prior_efficiency: float, probe_first: int):
        self.acceptance = AcceptanceModel()
        self.cost_samples: deque = deque(maxlen=64)
        self.draft_cost = DraftCost()
        self.run_seconds: deque = deque(maxlen=16)  # the last steady runs' seconds, whether they drafted or not
        self.ran_last = False      # it ran in the request's previous round (so a run now is steady: no catch-up)
        self.follow = False        # a probe that may show it cheap: run it the next round too, for a steady sample
        self._look: Optional[float] = None
        self.gain, self.steps = prior_efficiency, 1.0  # decayed sums: emitted tokens, plain-step units
        self.long_gain, self.long_steps = 0.0, 0.0  # the same over its last ~50 runs (LONG_DECAY), no prior
        self.off_rounds, self.probe_every = 0, probe_first
        self.one_hot = False       # its drafts are verified as one-hot q (no probabilities): step 3 may cut them
        self.retired = False       # out for the rest of this request
        self.probed = False        # probed in this request (a reader is retired only after a probe lost)
        self.sit_out, self.sit_out_gap = 0, 1  # requests left to sit out; the next retirement's
        self.lost_since_paid = False  # retired (or its calibration lost) and not paid since: one lost probe retires it

    @property
    def efficiency(self) -> float:
        return self.gain / max(1e-9, self.steps)

    @property
    def long_efficiency(self) -> float:
        """Tokens per plain step over its last ~50 runs, the runs that found nothing included: what running it
        every round has given lately (0 until its runs make `LONG_LEAST` plain steps)."""
        return self.long_gain / self.long_steps if self.long_steps >= LONG_LEAST else 0.0

    def record(self, emitted: float, steps: float, decay: float, own_steps: Optional[float] = None) -> None:
        """A round it ran in: `emitted` tokens (its draft's, or its expected value where another's won) in `steps`
        plain steps (the round's: every part's drafting); the long record counts `own_steps` (its own drafting and
        the verify), default `steps`."""
        self.gain, self.steps = decay * self.gain + emitted, decay * self.steps + steps
        self.record_long(emitted, steps if own_steps is None else own_steps)

    def record_long(self, emitted: float, steps: float) -> None:
        """A run in the long record only (one that found nothing while another part's draft was verified, or a
        round's empty parts)."""
        self.long_gain = LONG_DECAY * self.long_gain + emitted
        self.long_steps = LONG_DECAY * self.long_steps + steps

    def add_cost(self, k: int, seconds: float, steady: bool = True) -> None:
        """A run's seconds; `steady`: it ran in the round before too. Only steady runs time a run: the first after
        a pause (a probe, a request's first round) also catches up on what it missed (prompt lookup indexes every
        token since its last run), which running every round would not pay."""
        if seconds < 0:
            return
        if steady:
            self.run_seconds.append(seconds)
            self._look = None
        if k >= 1:
            self.cost_samples.append((k, seconds))
            self.draft_cost = fit_draft_cost(self.cost_samples)

    @property
    def look_cost(self) -> float:
        """Seconds a run costs on average, drafts or not: the mean of the recent steady runs without their slowest
        tenth (a pause of the machine is not the drafter's cost); the fitted cost of one token before any."""
        if self._look is None:
            if not self.run_seconds:
                return self.draft_cost(1)
            runs = sorted(self.run_seconds)[: max(1, (9 * len(self.run_seconds)) // 10)]
            self._look = sum(runs) / len(runs)
        return self._look


class AutoPolicy(LengthPolicy):
    name = "auto"

    def __init__(self, costs: Optional[CostTable] = None, max_draft: int = 64, tolerance: float = 0.01,
                 decay: float = 0.7, probe_first: int = 4, probe_max: int = 64, prior_efficiency: float = 1.1,
                 recalibrate: bool = False, calibrate: bool = True, progress: bool = False, cheap_share: float = 0.02,
                 retire_readers: bool = True, sit_out_max: int = 8):
        if not isinstance(max_draft, int) or max_draft < 1:
            raise DiffspecError(f"auto policy: max_draft must be an integer >= 1, got {max_draft!r}")
        if not 0.0 < decay < 1.0:
            raise DiffspecError(f"auto policy: decay must be in (0, 1), got {decay!r}")
        if not (isinstance(probe_first, int) and isinstance(probe_max, int) and 1 <= probe_first <= probe_max):
            raise DiffspecError(f"auto policy: need 1 <= probe_first <= probe_max, got {probe_first!r}, {probe_max!r}")
        if isinstance(sit_out_max, bool) or not isinstance(sit_out_max, int) or sit_out_max < 0:
            raise DiffspecError(f"auto policy: sit_out_max must be an integer >= 0 (requests), got {sit_out_max!r}")
        self.costs = costs
        self.max_draft, self.tolerance, self.decay = max_draft, tolerance, decay
        self.probe_first, self.probe_max, self.prior_efficiency = probe_first, probe_max, prior_efficiency
        self.recalibrate, self.calibrate, self.progress = recalibrate, calibrate, progress
        self.cheap_share = cheap_share
        self.retire_readers, self.sit_out_max = retire_readers, sit_out_max
        self.sources: dict = {}
        self._readers: tuple = ()
        self.calibration: dict = {}           # source -> where its prior came from (for describe / profile)
        self._context = 0
        self._curve: list = []
        self._curves: dict = {}
        self._plan: Optional[tuple] = None
        self._current: Optional[str] = None
        self._greedy = True
        self._values: dict = {}

    # --- set-up -------------------------------------------------------------------------------
    def source(self, name: str) -> _Source:
        if name not in self.sources:
            self.sources[name] = _Source(self.prior_efficiency, self.probe_first)
        return self.sources[name]

    def attach(self, target, drafter, engine_type=None) -> None:
        from ..costs import drafter_calibration, load_or_measure_verify_costs

        if self.costs is None:
            self.costs, _ = load_or_measure_verify_costs(target, recalibrate=self.recalibrate, progress=self.progress)
        self._curves = {}
        self._readers = tuple(p.name for p in (drafter.parts if drafter is not None else ())
                              if p.capabilities.needs_target_hidden_states)  # this engine's, not earlier attaches'
        for part in drafter.parts if drafter is not None else ():
            self.source(part.name).one_hot = not part.capabilities.gives_probabilities
        if drafter is None or not self.calibrate:
            return
        if engine_type is None:
            raise DiffspecError("the auto policy times its drafter through the engine that runs it: "
                                "attach(target, drafter, engine_type=...) (SpeculativeEngine passes its own class)")
        for part in drafter.parts:
            measure = (lambda part=part: calibrate_drafter(target, part, engine_type=engine_type))
            record, origin, _ = drafter_calibration(target, part, measure, recalibrate=self.recalibrate,
                                                    progress=self.progress)
            self.seed(part.name, record)
            self.calibration[part.name] = origin

    def seed(self, name: str, record: dict) -> None:
        """A calibration record ({'costs': [[k, s]..], 'acceptance': counts}) as this source's prior. Where the record
        judged at least `CALIBRATION_JUDGED` drafted tokens and says the source loses on this machine
        (`calibrated_value` under 1 - tolerance), its record starts there instead of at `prior_efficiency`, so it
        starts off, and it counts as having lost since it last paid: a reader of hidden states is then retired at its
        first lost probe (a live first request costs ~`probe_first` rounds of hidden states, not the ~2 x `probe_max`
        of the full schedule)."""
        src = self.source(name)
        for k, s in record.get("costs", []):
            src.add_cost(int(k), float(s))
        if record.get("acceptance"):
            counts = AcceptanceCounts.from_json(record["acceptance"])
            src.acceptance.seed(counts)
            if self.costs is not None and sum(counts.pos_judged) >= CALIBRATION_JUDGED:
                value = self.calibrated_value(name)
                if value < 1.0 - self.tolerance:
                    src.gain, src.steps = value, 1.0
                    src.lost_since_paid = True

    def calibrated_value(self, name: str) -> float:
        """Tokens per plain step of a round at the source's best draft length k >= 1, from what it has learnt (its
        acceptance by draft position, its draft cost) on this machine's verify curve at context
        `CALIBRATION_CONTEXT`."""
        src = self.source(name)
        curve = self.verify_curve(CALIBRATION_CONTEXT)
        p = src.acceptance.probabilities([], len(curve) - 1)
        rates = round_rates(p, curve, src.draft_cost.curve(len(p)))
        return max(rates[1:]) * curve[0]

    # --- per request and per round --------------------------------------------------------------
    def begin_request(self, greedy: bool) -> None:
        self._greedy = greedy
        for name, src in self.sources.items():
            src.acceptance.begin_request()
            src.off_rounds, src.probed = 0, False
            src.ran_last = src.follow = False
            src.retired = src.sit_out > 0
            if src.retired:
                src.sit_out -= 1
            elif name in self._readers and self.retire_readers:
                src.probe_every = self.probe_first  # live again: probe it afresh

    def wants_hidden_states(self) -> bool:
        return not any(self.source(name).retired for name in self._readers)

    def verify_curve(self, context: int) -> list:
        if self.costs is None:
            raise DiffspecError("the auto policy has no cost table: the engine attaches it (or pass costs=)")
        bucket = (context // 16) * 16
        if bucket not in self._curves:
            self._curves[bucket] = self.costs.verify_curve(self.max_draft, bucket)
        return self._curves[bucket]

    def plan_round(self, context_len: int, sources: Sequence[str]) -> tuple:
        self._context = context_len
        self._curve = self.verify_curve(context_len)
        self._values = {}
        plan = []
        for name in sources:
            src = self.source(name)
            if src.retired:
                continue
            cuttable = self._greedy or src.one_hot  # step 3 may cut its drafts
            long_pays = src.long_efficiency >= 1.0 and src.look_cost < LONG_RUN_SHARE * self._curve[0]
            if (cuttable and (self.is_cheap(src) or long_pays)) or src.efficiency >= 1.0 - self.tolerance:
                src.off_rounds, src.probe_every = 0, self.probe_first
                src.sit_out_gap, src.lost_since_paid = 1, False
                plan.append(name)
                continue
            if src.follow:  # the second round of a probe: a steady sample of what a run costs
                src.follow = False
                plan.append(name)
                continue
            # its probes up to probe_max lost, or it has lost since it last paid (retired, or its calibration lost):
            # then one lost probe will do. A probe counts once planned, whether it ran or was skipped because the
            # proposal in hand promised more than its record (combined drafters): either way it gave nothing.
            lost_enough = src.probe_every >= self.probe_max or src.lost_since_paid
            if name in self._readers and self.retire_readers and src.probed and lost_enough:
                src.retired, src.sit_out = True, min(src.sit_out_gap, self.sit_out_max)  # its probes all lost
                src.lost_since_paid = True
                src.sit_out_gap = min(2 * src.sit_out_gap, max(1, self.sit_out_max))
                continue
            src.off_rounds += 1
            if src.off_rounds >= src.probe_every:  # probe: the regime may have changed
                src.off_rounds, src.probe_every = 0, min(self.probe_max, 2 * src.probe_every)
                src.probed = True
                src.follow = (self._greedy or src.one_hot) and src.look_cost < FOLLOW_UP * self.cheap_share * self._curve[0]
                plan.append(name)
        self._plan = tuple(plan)
        if len(sources) == 1 and plan:
            self._current = plan[0]
        return self._plan

    def is_cheap(self, src: _Source) -> bool:
        """Runs whatever its record where its drafts may be cut (greedy, or one-hot drafts): a run costs under
        `cheap_share` of a plain step."""
        return src.look_cost < self.cheap_share * self._curve[0]

    def planned_sources(self) -> Optional[tuple]:
        return self._plan

    def select(self, source: str) -> None:
        self._current = source

    # --- lengths --------------------------------------------------------------------------------
    def _horizon(self) -> int:
        """The longest draft a round may verify: `max_draft`, within the round's verify curve."""
        return min(self.max_draft, len(self._curve) - 1)

    def _estimates(self, name: str, confidences: Sequence[float]) -> tuple:
        src = self.source(name)
        return src, src.acceptance.probabilities(list(confidences), self._horizon())

    def next_increment(self, confidences: Sequence[float]) -> int:
        if self._current is None:
            raise DiffspecError("the auto policy was asked for a draft length outside a planned round")
        src = self.source(self._current)
        drafted = len(confidences)
        horizon = self._horizon()
        if drafted >= horizon:
            return 0
        free_tokens = src.draft_cost.per_token_s < 0.02 * self._curve[0]
        if drafted == 0 and self._greedy and free_tokens:  # the whole block costs what its first token does:
            return horizon  # draft it all (the horizon), cut it later
        src, p = self._estimates(self._current, confidences)
        best = best_length(p, self._curve, src.draft_cost.curve(len(p)))
        return max(1, best) if drafted == 0 else max(0, best - drafted)

    def final_length(self, confidences: Sequence[float], draft_seconds: float) -> int:
        if self._current is None or not confidences:
            return len(confidences)
        src = self.source(self._current)
        p = src.acceptance.by_confidences(confidences)
        k = len(p)
        return best_rate(p, self._curve[: k + 1] + [self._curve[-1]] * max(0, k + 1 - len(self._curve)),
                         [draft_seconds] * (k + 1))[0]

    def draft_value(self, source: str, confidences: Sequence[float], draft_seconds: float) -> float:
        """Expected tokens per plain step of this proposal at its best length (plain decoding = 1)."""
        src = self.source(source)
        p = src.acceptance.by_confidences(confidences[: len(self._curve) - 1])
        value = best_rate(p, self._curve, [draft_seconds] * (len(p) + 1))[1] * self._curve[0]
        self._values[source] = (value, len(confidences), draft_seconds)
        return value

    def prior_value(self, source: str) -> float:
        return self.source(source).efficiency

    # --- feedback -------------------------------------------------------------------------------
    def update(self, stats) -> None:
        ran = {name for name, _, _ in stats.draft_costs}
        steady = {name for name in ran if self.source(name).ran_last}
        for name, src in self.sources.items():
            src.ran_last = name in ran
        if stats.speculation_off or not self._curve:
            return
        v0 = self._curve[0]
        spent = 0.0
        for name, k, seconds in stats.draft_costs:
            self.source(name).add_cost(k, seconds, steady=name in steady)
            spent += seconds
        chosen = stats.source
        if chosen:
            src = self.source(chosen)
            src.acceptance.update(stats.confidences, stats.accepted)
            own = sum(seconds for name, _, seconds in stats.draft_costs if name == chosen)
            verify = self._verify(stats.drafted)
            src.record(stats.emitted, (spent + verify) / v0, self.decay, own_steps=(own + verify) / v0)
        for name, k, seconds in stats.draft_costs:  # a part that ran and was not verified
            if name == chosen:
                continue
            if name in self._values:  # its proposal lost: its own expected value
                value, _, own = self._values[name]
                steps = (own + v0) / v0
                self.source(name).record(value * steps, steps, self.decay)
            elif k == 0:  # it found nothing: a plain step's token, at its run's cost
                self.source(name).record_long(1.0, (seconds + v0) / v0)
            # else: a draft drawn from q that lost on its record alone (sampling): no value to book

    def _verify(self, k: int) -> float:
        return self._curve[min(k, len(self._curve) - 1)]

    def describe(self) -> str:
        return f"auto(max {self.max_draft}, tolerance {self.tolerance})"


CALIBRATION_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "In two sentences, explain why the sky is blue.",
)


def calibrate_drafter(target, drafter, *, engine_type, new_tokens: int = 32, gammas: Sequence[int] = (2, 8)) -> dict:
    """A short run of `drafter` at fixed draft lengths through an engine of `engine_type` (SpeculativeEngine):
    its draft seconds per round (for the cost fit) and the acceptance counts its confidences earned (the
    prior of the acceptance model)."""
    import torch

    from .fixed import FixedPolicy

    counts = AcceptanceCounts()
    costs = []
    if target.tokenizer is not None:
        prompts = [target.encode_prompt(p, chat=target.tokenizer.chat_template is not None) for p in CALIBRATION_PROMPTS]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.vocab_size, (24,), generator=gen).tolist() for _ in CALIBRATION_PROMPTS]
    prompts = [p[-max(1, target.max_context // 2):] for p in prompts]  # a short context still calibrates
    room = max(1, min(new_tokens, target.max_context - max(len(p) for p in prompts) - 1))
    for gamma in gammas:
        engine = engine_type(target, drafter, FixedPolicy(gamma=gamma), allow_inexact=True)  # timing only
        engine.generate(prompts[0], max_new_tokens=min(4, room))  # warm-up: first calls pay one-off costs
        for ids in prompts:
            result = engine.generate(ids, max_new_tokens=room)
            for r in result.rounds:
                costs.append([r.drafted, round(r.draft_time_s, 6)])
                counts.add(r.confidences, r.accepted)
    return {"costs": costs, "acceptance": counts.to_json(), "gammas": list(gammas), "new_tokens": room}
