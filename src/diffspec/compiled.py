"""Compiled target passes (issue 19): `--compile off|on|auto` for the transformers backend.

`torch.compile` (inductor, `dynamic=True`) of the target's forward, traced through our position-indexed
cache (cache.py) and the measured matmul plan (kernels.py). The cache length is symbolic: a request's
growing context reuses one graph. The pass width is not: torch specialises every width (and every
set of returned hidden states) into its own graph, so a graph is compiled per distinct pass shape, on
its first use. What the graphs cost and save, on a 2-core AVX-512 EPYC with SmolLM2-135M
(`benchmarks/results/issue19_engine/ab3_compile_avx512.json`): the one-row pass compiles in ~30 s
(warm inductor cache or not: most of it is dynamo tracing transformers' Python) and then runs in
24 ms against 32 ms eager; the 2-row pass ~35 s, each further width 13-15 s; verify passes of 2-9
rows run 1.15-1.3x faster than eager, 17 rows no faster.

The modes:
- `off` (default): eager, as before.
- `on`: every decoding or verify pass of at most MAX_COMPILED_WIDTH rows runs compiled, all of them
  compiled at start (`compile_widths`: 4-11 min on a 2-core CPU, each width reported), so no request
  stalls on a compile. Prefills stay eager (their widths are the prompts' lengths, and a
  pass on an empty cache would be another graph). For long-lived processes (`serve`, `bench`).
- `auto`: at start, compile the one-row pass (every plain step and every round without drafts is
  one), time it against eager (interleaved), and keep it where it is at least 1/AUTO_MARGIN faster;
  wider passes stay eager (on a CPU each would cost a minute to compile for a few ms a pass).
  The decision is cached per machine, model and torch version: where eager won, later starts skip
  the compile. Compiled code itself is cached by torch's inductor (its FX graph cache), not by us.

Exactness: a compiled pass computes the same sums with other (fused) kernels, so its logits may differ
from eager's in the last bits (2e-5 measured on SmolLM2 in float32). With `on` or `auto`, plain
decoding and speculative decoding run the same compiled one-row pass; verify passes of 2+ rows run
eager under `auto`, so a greedy token decided by a near-tie (top-1 lead below ~1e-4) may come out
differently than plain decoding's. The default stays `off`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from .errors import DiffspecError

COMPILE_MODES = ("off", "on", "auto")
#: `on` compiles passes up to this many rows (verify passes of up to 16 drafted tokens); wider ones run eager
MAX_COMPILED_WIDTH = 17
#: `auto` keeps the compiled one-row pass only where it timed at least this much faster
AUTO_MARGIN = 0.95
FORMAT = 1

#: what selects a graph: (rows, all logits?). A compiled pass always returns every layer's hidden
#: states (they exist anyway), so passes that read them (the conditioned drafter's) share its graph.
PassShape = Tuple[int, bool]


def check_compile(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise DiffspecError(f"unknown --compile '{mode}' (choose from: {', '.join(COMPILE_MODES)})")


def check_compilable(config, name: str = "this model") -> None:
    """Compiled passes are built and tested for caches whose every layer is full attention (our
    position-indexed layers); a sliding-window layer's past recording and cropping were not traced
    and checked, so such models are refused by name rather than run untested."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise DiffspecError(f"--compile supports models whose attention layers are all full attention; {name} has "
                            f"{', '.join(other)} layers (e.g. Gemma 3's sliding window): use --compile off")


def _allow_graphs(count: int) -> None:
    """torch recompiles at most `recompile_limit` (default 8) times per function, then falls back to
    eager for good, silently: allow one graph per shape we compile."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < count:
        dynamo_config.recompile_limit = count


@dataclass
class CompiledPasses:
    """Which of a target's passes run compiled, and what compiling them cost."""

    mode: str = "off"
    fn: Optional[object] = None                      # torch.compile(model.forward)
    shapes: Optional[set] = None                     # the shapes that run compiled (None with `on`: all small ones)
    compile_s: Dict[str, float] = field(default_factory=dict)  # shape -> seconds of its first (compiling) pass
    decision: dict = field(default_factory=dict)     # auto's measurement
    quiet: bool = True

    @classmethod
    def build(cls, model: torch.nn.Module, mode: str, quiet: bool = True) -> "CompiledPasses":
        check_compile(mode)
        if mode == "off":
            return cls("off", quiet=quiet)
        check_compilable(model.config)
        _allow_graphs(4 * MAX_COMPILED_WIDTH)
        fn = torch.compile(model.forward, dynamic=True)
        return cls(mode, fn, None if mode == "on" else set(), quiet=quiet)

    def runs(self, shape: PassShape) -> bool:
        """Whether a pass of this shape runs compiled. Prefills (passes that keep only the last logits,
        and any pass wider than MAX_COMPILED_WIDTH) never do; nor a pass on an empty cache (Target.forward)."""
        if self.fn is None or shape[0] > MAX_COMPILED_WIDTH or not shape[1]:
            return False
        return self.shapes is None or shape in self.shapes

    @property
    def one_row(self) -> bool:
        """Whether plain decoding's one-row pass runs compiled."""
        return self.runs((1, True))

    def timed_first(self, shape: PassShape, seconds: float) -> None:
        """Record (and report) the first pass of a shape: the one that compiled it."""
        key = f"{shape[0]} rows"
        if key in self.compile_s:
            return
        self.compile_s[key] = round(seconds, 2)
        if not self.quiet:
            print(f"diffspec: compiled the target's {key} pass in {seconds:.1f} s", file=sys.stderr, flush=True)

    def describe(self) -> str:
        if self.fn is None:
            return "eager"
        if self.shapes is None:
            return f"compiled (passes of up to {MAX_COMPILED_WIDTH} rows)"
        return "compiled one-row pass" if self.shapes else "eager (auto: compiled one-row pass measured slower)"

    def to_json(self) -> dict:
        return {"mode": self.mode, "runs": self.describe(), "compile_s": dict(self.compile_s),
                "decision": dict(self.decision)}


def compile_widths(target, context: int = 32) -> None:
    """`--compile on`: compile the pass of every width up to MAX_COMPILED_WIDTH now (at start), on a
    scratch context. Leaves the target's cache empty."""
    if not target.compiled.quiet:
        print(f"diffspec: --compile on: compiling the target's passes of 1 to {MAX_COMPILED_WIDTH} rows (once per "
              f"process; minutes on a CPU)", file=sys.stderr, flush=True)
    ids = torch.randint(0, target.vocab_size, (context + MAX_COMPILED_WIDTH,),
                        generator=torch.Generator().manual_seed(0))
    target.reset()
    target.reserve(context + MAX_COMPILED_WIDTH)
    target.forward(ids[:context], logits=False)
    for width in range(1, MAX_COMPILED_WIDTH + 1):
        target.forward(ids[context:context + width])  # Target.forward records the compile time
        target.truncate(context)
    target.reset()
    target.forward_passes = 0


def decision_path(target):
    from .costs import cache_key, cost_dir, machine_key

    key = cache_key("compile-auto", FORMAT, machine_key(target.device), str(target.dtype), target.base_fingerprint,
                    torch.__version__, AUTO_MARGIN)
    return cost_dir() / f"compile-auto-{key}.json"


def choose_one_row(target, context: int = 64, reps: int = 7) -> None:
    """`--compile auto`: compile the target's one-row pass and keep it where it measures faster than
    eager (interleaved passes at a `context`-token context, medians). Leaves the target's cache empty."""
    from .output import try_write_cache

    passes = target.compiled
    where = decision_path(target)
    try:
        cached = json.loads(where.read_text())
        if cached.get("format") == FORMAT and cached.get("keep") is False:
            passes.decision = {**cached, "origin": "cache"}
            return
    except (OSError, ValueError, AttributeError):
        pass
    shape: PassShape = (1, True)
    ids = torch.randint(0, target.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(0))
    target.reset()
    target.reserve(context + 1)
    target.forward(ids[:context], logits=False)
    if not passes.quiet:
        print("diffspec: --compile auto: compiling the target's one-row pass (once per process; ~30 s on a "
              "2-core CPU)", file=sys.stderr, flush=True)
    passes.shapes.add(shape)

    def one(compiled: bool) -> float:
        if not compiled:
            passes.shapes.discard(shape)
        t0 = time.perf_counter()
        target.forward(ids[context:context + 1])
        seconds = time.perf_counter() - t0
        passes.shapes.add(shape)
        target.truncate(context)
        return seconds

    one(True)  # compiles (Target.forward records the time)
    eager, compiled = [], []
    for _ in range(reps):
        eager.append(one(False))
        compiled.append(one(True))
    eager_ms, compiled_ms = sorted(eager)[reps // 2] * 1e3, sorted(compiled)[reps // 2] * 1e3
    keep = compiled_ms < AUTO_MARGIN * eager_ms
    if not keep:
        passes.shapes.clear()
    passes.decision = {"format": FORMAT, "keep": keep, "eager_ms": round(eager_ms, 2),
                       "compiled_ms": round(compiled_ms, 2), "context": context, "origin": "measured"}
    if not passes.quiet:
        print(f"diffspec: --compile auto: one-row pass {compiled_ms:.1f} ms compiled, {eager_ms:.1f} ms eager: "
              f"{'keeping the compiled pass' if keep else 'staying eager'}", file=sys.stderr, flush=True)
    try_write_cache(where, json.dumps(passes.decision), "the compile decision")
    target.reset()
    target.forward_passes = 0
