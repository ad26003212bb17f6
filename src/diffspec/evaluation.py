"""Drafter health check: how much of the target's own held-out text a drafter would get accepted.

For the prompts of the evaluation sets (never trained on), the target answers greedily
(`target_continuations`, cached on disk per target, tokenizer, set, prompt count and length, so a
ladder of drafters pays for them once). One teacher-forced target pass per continuation gives the
truth labels: `truth[t]` = the target's argmax at position t, its choice for token t+1 (and, for a
drafter that reads them, the hidden states of its `target_layer_ids`, laid out exactly as the
engine hands them over: `Target.forward(..., hidden_layers=...)`).

At anchors a in the continuation (prompt_len - 1 <= a, a + B - 1 < len), the drafter drafts B - 1
tokens after ids[:a+1] through the public contract only (begin / observe / propose, greedy, a
fixed policy of B - 1): a drafter that needs hidden states has been handed those of every
position < a, in order, as the engine would have. L = the number of leading drafted tokens equal
to the truth: what one greedy verification round of that block would accept.

Per domain (humaneval: code, mtbench: chat, champ: math) and overall (anchors pooled):
p_k = share of anchors with L >= k (k = 1..B-1) and tau = 1 + mean(L) = 1 + sum_k p_k, the
accepted tokens per round of a fixed block, bonus token counted. tau < 1.2 flags a collapsed
drafter (a warning per domain).

Beside prompt lookup: the default pairs a trained drafter with prompt lookup, which drafts where the
context repeats and is then usually right. So each domain also reports the drafter's p_1 and tau on
the anchors where prompt lookup (as the default runs it) drafts nothing: there the drafter alone must
pay for its rounds. Not for prompt lookup itself or a combination holding it.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from .defaults import EVALUATION_DOMAINS
from .errors import DiffspecError
from .output import pyplot_or_warn, write_atomically

DOMAINS = EVALUATION_DOMAINS  # evaluation set -> domain
DEFAULT_SETS = tuple(DOMAINS)
DEFAULT_BLOCK_SIZE = 16  # for a drafter with no per-round cap
COLLAPSE_TAU = 1.2       # tau below this: the drafter gets (almost) nothing accepted
CACHE_FORMAT = 1         # bump when what a cached continuation file holds changes


@dataclass(frozen=True)
class Continuation:
    """A prompt and the target's greedy answer to it: ids = prompt + response."""
    ids: tuple
    prompt_len: int


@dataclass(frozen=True)
class DomainHealth:
    """Acceptance of one domain's anchors (or of all of them: domain 'overall')."""
    domain: str
    sets: tuple                 # the evaluation sets pooled here
    sequences: int              # continuations with at least one anchor
    anchors: int
    slot_acceptance: tuple      # p_k for k = 1..B-1: share of anchors whose first k drafts all match
    tau: float                  # 1 + mean leading matches: accepted tokens per round, bonus counted
    leading_histogram: tuple    # anchors with exactly L leading matches, L = 0..B-1
    collapsed: bool             # tau < COLLAPSE_TAU
    lookup_silent_anchors: Optional[int] = None  # anchors where prompt lookup drafts nothing (None: not measured)
    lookup_silent_p1: Optional[float] = None     # p_1 on those anchors (None: none, or not measured)
    lookup_silent_tau: Optional[float] = None    # tau on those anchors

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sets"], d["slot_acceptance"], d["leading_histogram"] = list(self.sets), list(self.slot_acceptance), \
            list(self.leading_histogram)
        return d


@dataclass(frozen=True)
class DrafterHealth:
    """The health check of one drafter on one target (see the module docstring)."""
    drafter: str                # the drafter's describe()
    target: str
    block_size: int             # B: B - 1 drafted slots per anchor
    num_prompts: int
    max_new_tokens: int
    anchors_per_sequence: Optional[int]  # None: every anchor
    domains: tuple              # DomainHealth per domain with anchors, in the order of the sets
    overall: DomainHealth
    wall_time_s: float
    collapse_tau: float = COLLAPSE_TAU

    @property
    def collapsed(self) -> bool:
        return self.overall.collapsed or any(d.collapsed for d in self.domains)

    def domain(self, name: str) -> DomainHealth:
        for d in self.domains + (self.overall,):
            if d.domain == name:
                return d
        raise KeyError(name)

    def warnings(self) -> list:
        """One line per collapsed domain (and overall)."""
        return [f"drafter '{self.drafter}' collapsed on {d.domain}: tau {d.tau:.3f} < {self.collapse_tau} "
                f"(p1 {d.slot_acceptance[0]:.3f} over {d.anchors} anchors): it drafts almost nothing the target accepts"
                for d in self.domains + (self.overall,) if d.collapsed]

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "target": self.target, "block_size": self.block_size,
                "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
                "anchors_per_sequence": self.anchors_per_sequence, "collapse_tau": self.collapse_tau,
                "collapsed": self.collapsed, "wall_time_s": round(self.wall_time_s, 3),
                "domains": {d.domain: d.to_dict() for d in self.domains}, "overall": self.overall.to_dict()}

    def table(self) -> str:
        """Plain-text table: domain, tau, p1..p(B-1), anchors, sequences."""
        slots = self.block_size - 1
        head = f"{'domain':8s} {'tau':>6s} " + " ".join(f"{'p' + str(k):>5s}" for k in range(1, slots + 1)) + \
               f" {'anchors':>8s} {'seqs':>5s}"
        lines = [head]
        for d in self.domains + (self.overall,):
            lines.append(f"{d.domain:8s} {d.tau:6.3f} " + " ".join(f"{p:5.3f}" for p in d.slot_acceptance) +
                         f" {d.anchors:8d} {d.sequences:5d}" + ("  COLLAPSED" if d.collapsed else ""))
        beside = [d for d in self.domains + (self.overall,) if d.lookup_silent_anchors is not None]
        if beside:
            lines.append("where prompt lookup drafts nothing (the default pairs them):")
            for d in beside:
                share = d.lookup_silent_anchors / d.anchors if d.anchors else 0.0
                there = (f"tau {d.lookup_silent_tau:6.3f}  p1 {d.lookup_silent_p1:5.3f}"
                         if d.lookup_silent_p1 is not None else "(no such anchor)")
                lines.append(f"{d.domain:8s} {there}  on {d.lookup_silent_anchors} anchors ({share:.0%})")
        return "\n".join(lines)


# --- arguments ---------------------------------------------------------------------------------
def check_eval_args(sets: Optional[Sequence[str]] = DEFAULT_SETS, num_prompts: int = 10, max_new_tokens: int = 128,
                    block_size: Optional[int] = None, anchors_per_sequence: Optional[int] = None) -> None:
    """Refuse bad arguments by name (the CLI calls this before any model loads). sets=None: not checked."""
    from .datasets import SETS

    if sets is not None:
        if not sets:
            raise DiffspecError("no evaluation set named (choose from: " + ", ".join(SETS) + ")")
        unknown = [s for s in sets if s not in SETS]
        if unknown:
            raise DiffspecError(f"unknown dataset '{unknown[0]}' (choose from: {', '.join(SETS)})")
    for name, value, least in (("--num-prompts", num_prompts, 1), ("--max-new-tokens", max_new_tokens, 2),
                               ("--block-size", block_size, 2), ("--anchors-per-sequence", anchors_per_sequence, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise DiffspecError(f"{name} must be an integer >= {least}, got {value!r}")


def default_block_size(drafter) -> int:
    """The drafter's whole round (max_tokens_per_round + 1) where it has a cap, else DEFAULT_BLOCK_SIZE."""
    cap = drafter.max_tokens_per_round
    return cap + 1 if cap else DEFAULT_BLOCK_SIZE


# --- held-out continuations --------------------------------------------------------------------
def eval_cache_dir() -> Path:
    """Where cached continuations live: $DIFFSPEC_CACHE/eval, else ~/.cache/diffspec/eval."""
    from .models import cache_root

    return cache_root() / "eval"


def render_set_prompts(target, set_name: str, num_prompts: int) -> list:
    """The first `num_prompts` non-empty prompts of an evaluation set as token ids, rendered as
    `diffspec bench` renders them (the chat template, `Target.encode_prompt`)."""
    from .bench.prompts import load_bench_prompts

    return [target.encode_prompt(p.text, chat=True) for p in load_bench_prompts(set_name, num_prompts)]


def target_continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 8,
                         progress: bool = False, desc: str = "continuations") -> list:
    """The target's greedy answers (batched), up to its stop tokens -> [Continuation]. Answers of one
    token or less are dropped. The one place that generates (the generator may change)."""
    from .training.store import generate_batch

    if target.tokenizer is None:
        raise DiffspecError("the target has no tokenizer: its answers need one (pad and stop tokens)")
    for ids in prompts:
        if len(ids) + max_new_tokens > target.max_context:
            raise DiffspecError(f"a prompt of {len(ids)} tokens plus {max_new_tokens} new ones exceeds the target's "
                                f"context of {target.max_context}")
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    answers = [None] * len(prompts)
    bar = _bar(len(prompts), desc, progress)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            # the model's forward, on any device: these answers are cached as the target's own, whatever
            # make-data's faster step would round differently (training/batch_step.py)
            out = generate_batch(target.model, [list(prompts[i]) for i in idx], max_new_tokens,
                                 sorted(target.stop_token_ids), pad, decode_step="model")
            for i, response in zip(idx, out):
                answers[i] = response
            bar.update(len(idx))
    finally:
        bar.close()
    return [Continuation(tuple(int(t) for t in list(p) + a), len(p)) for p, a in zip(prompts, answers) if len(a) > 1]


def continuation_key(target_name: str, fingerprint: Optional[str], set_name: str, num_prompts: int,
                     max_new_tokens: int, dtype: str, prompts: Sequence[Sequence[int]]) -> dict:
    """What a cached continuation file must match: the target, its tokenizer and dtype, the set, the
    prompt count and answer length, and the rendered prompt ids themselves (a changed template or
    prompt set misses the cache instead of reading stale answers)."""
    digest = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16]
    return {"format": CACHE_FORMAT, "target": target_name, "tokenizer": fingerprint, "set": set_name,
            "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "dtype": dtype, "prompts": digest}


def cache_path(cache_dir: Path, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    safe_set = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(key["set"]))[:40]
    return Path(cache_dir) / f"{safe_set}-{name}.json"


def read_cached(path: Path, key: dict) -> Optional[list]:
    """The continuations of a cache file whose key matches, else None (missing, corrupt or stale)."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("key") != key:
            return None
        return [Continuation(tuple(int(t) for t in c["ids"]), int(c["prompt_len"])) for c in data["continuations"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_continuations(target, set_name: str, prompts: Sequence[Sequence[int]], num_prompts: int,
                         max_new_tokens: int, cache_dir: Optional[Path] = None, progress: bool = False,
                         fingerprint: Optional[str] = None) -> list:
    """`target_continuations`, read from the cache when an earlier run made them (see continuation_key)."""
    fingerprint = fingerprint if fingerprint is not None else target.tokenizer_fingerprint
    key = continuation_key(target.name, fingerprint, set_name, num_prompts, max_new_tokens,
                           str(target.dtype).replace("torch.", ""), prompts)
    path = cache_path(eval_cache_dir() if cache_dir is None else cache_dir, key)
    cached = read_cached(path, key)
    if cached is not None:
        return cached
    conts = target_continuations(target, prompts, max_new_tokens, progress=progress, desc=f"answers {set_name}")
    write_atomically(path, json.dumps({"key": key, "continuations": [{"ids": list(c.ids), "prompt_len": c.prompt_len}
                                                                     for c in conts]}))
    return conts


# --- drafting ----------------------------------------------------------------------------------
def anchor_positions(prompt_len: int, length: int, block_size: int, per_sequence: Optional[int] = None) -> list:
    """Anchors a with prompt_len - 1 <= a and a + block_size - 1 < length, increasing: all of them, or
    `per_sequence` evenly spaced ones (first and last included)."""
    lo, hi = max(0, prompt_len - 1), length - block_size  # inclusive bounds
    if hi < lo:
        return []
    count = hi - lo + 1
    if per_sequence is None or per_sequence >= count:
        return list(range(lo, hi + 1))
    if per_sequence == 1:
        return [lo]
    return [lo + (i * (count - 1)) // (per_sequence - 1) for i in range(per_sequence)]


def leading_matches(drafted: Sequence[int], truth: Sequence[int]) -> int:
    """How many leading drafted tokens equal the truth (what greedy verification accepts)."""
    from .cache import common_prefix_length

    return common_prefix_length([int(d) for d in drafted], [int(t) for t in truth])


@torch.inference_mode()
def truth_pass(target, ids: Sequence[int], layers: Sequence[int] = ()) -> tuple:
    """One teacher-forced target pass over ids -> (truth [T] int64: the argmax at each position,
    hidden [T, len(layers) * H] or None), through `Target.forward` as the engine calls it."""
    target.reset()
    try:
        out = target.forward(torch.tensor(list(ids), dtype=torch.long, device=target.device), hidden_layers=tuple(layers))
    finally:
        target.reset()
    return out.greedy_tokens(), out.hidden_states


def draft_at_anchors(drafter, cont: Continuation, truth: torch.Tensor, hidden: Optional[torch.Tensor],
                     anchors: Sequence[int], block_size: int, device="cpu", on_anchor=None) -> list:
    """Leading matches L at each anchor of one continuation (increasing anchors; one request).

    The drafter begins with the prompt; before drafting at anchor a, a drafter that reads hidden
    states has been handed those of positions < a (incrementally, as the engine does)."""
    from .policies import FixedPolicy
    from .types import SamplingParams

    ids = torch.tensor(cont.ids, dtype=torch.long, device=device)
    slots = block_size - 1
    policy, greedy = FixedPolicy(slots), SamplingParams()
    truth = truth.tolist()
    drafter.begin(ids[:cont.prompt_len])
    seen, leads = 0, []
    for a in anchors:
        if hidden is not None and a > seen:
            drafter.observe(hidden[seen:a], seen)
            seen = a
        draft = drafter.propose(ids[:a + 1], policy, slots, greedy, None)
        leads.append(leading_matches(draft.tokens[:slots].tolist(), truth[a:a + slots]))
        if on_anchor is not None:
            on_anchor()
    return leads


def lookup_silent_at(cont: Continuation, anchors: Sequence[int], block_size: int, lookup=None) -> list:
    """Per anchor a: whether prompt lookup, as the default runs it beside a trained drafter, drafts nothing
    after ids[:a+1] (greedy, a fixed policy of B - 1)."""
    from .drafters.prompt_lookup import PromptLookupDrafter
    from .policies import FixedPolicy
    from .types import SamplingParams

    lookup = lookup or PromptLookupDrafter()
    ids = torch.tensor(cont.ids, dtype=torch.long)
    slots = block_size - 1
    policy, greedy = FixedPolicy(slots), SamplingParams()
    lookup.begin(ids[:cont.prompt_len])
    return [len(lookup.propose(ids[:a + 1], policy, slots, greedy, None)) == 0 for a in anchors]


def summarize_leads(domain: str, sets: Sequence[str], leads_per_sequence: Sequence[Sequence[int]],
                    block_size: int, collapse_tau: float = COLLAPSE_TAU,
                    silent_per_sequence: Optional[Sequence[Sequence[bool]]] = None) -> DomainHealth:
    """Per-slot acceptance and tau of the leading-match counts of some sequences' anchors; with
    `silent_per_sequence` (per anchor: prompt lookup drafts nothing there), p_1 and tau on those anchors too."""
    leads = [L for seq in leads_per_sequence for L in seq]
    beside = {}
    if silent_per_sequence is not None:
        silent = [L for seq, flags in zip(leads_per_sequence, silent_per_sequence, strict=True)
                  for L, quiet in zip(seq, flags, strict=True) if quiet]
        beside = {"lookup_silent_anchors": len(silent),
                  "lookup_silent_p1": sum(1 for L in silent if L >= 1) / len(silent) if silent else None,
                  "lookup_silent_tau": 1.0 + sum(silent) / len(silent) if silent else None}
    n = len(leads)
    slots = block_size - 1
    hist = [0] * (slots + 1)
    for L in leads:
        hist[min(L, slots)] += 1
    p = tuple(sum(1 for L in leads if L >= k) / n for k in range(1, slots + 1))
    tau = 1.0 + sum(leads) / n
    return DomainHealth(domain=domain, sets=tuple(sets), sequences=sum(1 for s in leads_per_sequence if s),
                        anchors=n, slot_acceptance=p, tau=tau, leading_histogram=tuple(hist),
                        collapsed=tau < collapse_tau, **beside)


def evaluate_drafter(drafter, target, sets: Sequence[str] = DEFAULT_SETS, num_prompts: int = 10,
                     max_new_tokens: int = 128, block_size: Optional[int] = None,
                     anchors_per_sequence: Optional[int] = None, progress: bool = False,
                     prompts: Optional[Mapping[str, Sequence[Sequence[int]]]] = None,
                     cache_dir: Optional[Path] = None) -> "DrafterHealth":
    """Health check of `drafter` (any Drafter; attached to `target` here) on the target's own greedy
    continuations of held-out prompts (see the module docstring).

    sets: evaluation sets (humaneval, mtbench, champ); `prompts` replaces them with token-id prompts
    per set name (a set named like a packaged one gets its domain; the first `num_prompts` are used).
    block_size: B, default the drafter's round + 1 (else 16). anchors_per_sequence: evenly spaced
    anchors per continuation (None: all). cache_dir: where continuations are cached (default
    eval_cache_dir()). Warns for each collapsed domain."""
    t0 = time.perf_counter()
    sets = tuple(prompts) if prompts is not None else tuple(sets)
    check_eval_args(None if prompts is not None else sets, num_prompts, max_new_tokens, block_size,
                    anchors_per_sequence)
    if not sets:
        raise DiffspecError("no prompts to evaluate on")
    drafter.attach(target)
    B = block_size if block_size is not None else default_block_size(drafter)
    cap = drafter.max_tokens_per_round
    if cap is not None and B - 1 > cap:
        warnings.warn(f"block size {B} asks for {B - 1} drafted tokens; drafter '{drafter.name}' drafts at most "
                      f"{cap} a round, so slots {cap + 1}.. are never accepted", stacklevel=2)
    layers = tuple(drafter.target_layer_ids) if drafter.capabilities.needs_target_hidden_states else ()
    fingerprint = target.tokenizer_fingerprint

    conts = {}
    for s in sets:
        ids = [list(p) for p in prompts[s]][:num_prompts] if prompts is not None else \
            render_set_prompts(target, s, num_prompts)
        conts[s] = cached_continuations(target, s, ids, num_prompts, max_new_tokens, cache_dir, progress, fingerprint)

    plan = {s: [anchor_positions(c.prompt_len, len(c.ids), B, anchors_per_sequence) for c in conts[s]] for s in sets}
    bar = _bar(sum(len(a) for s in sets for a in plan[s]), f"drafting ({drafter.name})", progress)
    beside_lookup = "prompt-lookup" not in drafter.name.split("+")  # prompt lookup beside itself says nothing
    leads, silent = {}, {}
    try:
        for s in sets:
            leads[s], silent[s] = [], []
            for cont, anchors in zip(conts[s], plan[s]):
                if not anchors:
                    continue
                truth, hidden = truth_pass(target, cont.ids, layers)
                leads[s].append(draft_at_anchors(drafter, cont, truth, hidden, anchors, B, target.device, bar.update))
                if beside_lookup:
                    silent[s].append(lookup_silent_at(cont, anchors, B))
    finally:
        bar.close()

    by_domain = {}  # domain -> sets pooled into it, in first-seen order
    for s in sets:
        by_domain.setdefault(DOMAINS.get(s, s), []).append(s)
    domains = []
    for domain, members in by_domain.items():
        seqs = [L for s in members for L in leads[s]]
        if not seqs:
            warnings.warn(f"no anchors on {domain} ({', '.join(members)}): every continuation is shorter than "
                          f"its prompt plus a block of {B}", stacklevel=2)
            continue
        flags = [f for s in members for f in silent[s]] if beside_lookup else None
        domains.append(summarize_leads(domain, members, seqs, B, silent_per_sequence=flags))
    every = [L for s in sets for L in leads[s]]
    if not every:
        raise DiffspecError(f"no anchors to draft at: no continuation is longer than its prompt plus a block of {B} "
                            f"(raise --max-new-tokens or lower --block-size)")
    health = DrafterHealth(drafter=drafter.describe(), target=target.name, block_size=B, num_prompts=num_prompts,
                           max_new_tokens=max_new_tokens, anchors_per_sequence=anchors_per_sequence,
                           domains=tuple(domains),
                           overall=summarize_leads("overall", sets, every, B, silent_per_sequence=[
                               f for s in sets for f in silent[s]] if beside_lookup else None),
                           wall_time_s=time.perf_counter() - t0)
    for line in health.warnings():
        warnings.warn(line, stacklevel=2)
    return health


# --- output ------------------------------------------------------------------------------------
def write_health(health: DrafterHealth, out_dir) -> list:
    """Write health.json and slot_acceptance.png (skipped with a warning without matplotlib) into
    out_dir -> the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "health.json"
    write_atomically(path, json.dumps(health.to_dict(), indent=2) + "\n")
    written = [path]
    png = plot_slot_acceptance(health, out / "slot_acceptance.png")
    if png is not None:
        written.append(png)
    return written


def plot_slot_acceptance(health: DrafterHealth, path) -> Optional[Path]:
    """One line per domain (overall dashed): x = slot 1..B-1, y = share of anchors accepting it."""
    plt = pyplot_or_warn("slot_acceptance.png")
    if plt is None:
        return None

    slots = list(range(1, health.block_size))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    try:
        for d in health.domains:
            ax.plot(slots, d.slot_acceptance, marker="o", label=f"{d.domain} (tau {d.tau:.2f}, {d.anchors} anchors)")
        o = health.overall
        ax.plot(slots, o.slot_acceptance, linestyle="--", color="black", label=f"overall (tau {o.tau:.2f})")
        ax.set_xlabel("drafted slot k")
        ax.set_ylabel("acceptance p_k (all of slots 1..k match)")
        ax.set_ylim(0, 1.02)
        ax.set_xticks(slots)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        taus = ", ".join(f"{d.domain} {d.tau:.2f}" for d in health.domains)
        name = health.drafter if len(health.drafter) <= 90 else "..." + health.drafter[-87:]  # the tail says most
        ax.set_title(f"{name}\nblock {health.block_size}; tau: {taus}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


def _bar(total: int, desc: str, enabled: bool):
    """eval-drafter's bar on stderr (progress.progress_bar), cleared at close on a terminal."""
    from .progress import progress_bar

    return progress_bar(total, desc, enabled=enabled, leave=False)
