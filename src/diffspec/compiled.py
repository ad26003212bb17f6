"""Compiled target passes (issue 19): `--compile off|on|auto` for the transformers backend.

`torch.compile` (inductor, `dynamic=True`) of the target's forward, traced through our position-indexed
cache (cache.py) and the measured matmul plan (kernels.py). The cache length is symbolic: a request's
growing context reuses one graph. The pass width is not: torch specialises every width into its own
graph. So widths are bucketed: a pass of n rows runs the graph of the smallest width in WIDTH_BUCKETS
that holds it, its tokens padded with copies of the last one (Target.forward). The padding rows come
after the real ones, so causal attention keeps them out of every real row; their logits are dropped
and their cache positions cut off right after the pass (a length moved, as in a rollback). The input
ids are always a fresh tensor: torch also specialises a tensor's storage offset when it is 0 or 1, and
the engine's token tensors are views at any offset, so without the copy a width compiled again the
first time its ids started a tensor (stalls of ~1 minute each, seen in the bench).

What the graphs cost and save, on a 2-core AVX-512 EPYC with SmolLM2-135M
(`benchmarks/results/issue19_engine/ab3_compile_avx512.json`, `ab4_buckets_avx512.json`): a width
compiles in 55-80 s cold, 11-20 s with inductor's on-disk cache warm (the one-row and two-row
passes 30-50 s either way: most of it is dynamo tracing transformers' Python). The one-row pass then
runs in 24 ms against 31 ms eager; verify passes of 2-8 rows 1.2-1.3x faster than eager; from 9
rows the matmuls dominate (MKL's GEMM) and compiling saves 5-15%.

Compiled passes trace transformers' forward. Eager passes of a Llama-architecture target on a CPU run the
direct pass instead (llama_pass.py: the same arithmetic, bitwise, with fewer calls), which is what `auto`
times its compiled one-row pass against.

The modes:
- `off` (default): eager, as before.
- `on`: every decoding or verify pass of at most WIDTH_BUCKETS[-1] rows runs compiled, the graph of
  each bucket compiled at start (`compile_widths`: ~3 min with inductor's cache warm, ~11 cold on a
  2-core CPU; each width reported), so no request stalls on a compile. Prefills stay eager (their
  widths are the prompts' lengths, and a pass on an empty cache would be another graph). For
  long-lived processes (`serve`, `bench`).
- `auto`: at start, compile the one-row pass (every plain step and every round without drafts is
  one), time it against eager (interleaved), and keep it where it is at least 1/AUTO_MARGIN faster;
  wider passes stay eager (on a CPU each would cost a minute to compile for a few ms a pass).
  The decision is cached per machine, model and torch version: where eager won, later starts skip
  the compile. Compiled code itself is cached by torch's inductor (its FX graph cache), not by us.

On CUDA, CUDA graphs: eager PyTorch is launch-bound there on small models (a pass of a 135M model cost
~25 ms on an H100 whatever its width: hundreds of kernel launches), and a graph replays a whole pass
in one launch. A graph needs fixed shapes and fixed addresses, which a cache whose length grows does
not give; so on CUDA, compiled passes run over a fixed-capacity cache (cache.new_fixed_cache:
transformers' StaticCache, rolled back by setting its length) with static shapes, under inductor's
`reduce-overhead` (CUDA graph trees): one graph per width and capacity (capacities are powers of two
from 2048, never shrinking, so a process records few), recorded at start under `on` (each width run
three times: CUDA graph trees warm up, then record; their trees are per thread, so `serve`, whose
engine runs on its own thread, records them once more there on first use: no compile). A request
longer than the capacity moves to the next power of two, whose widths compile when first run (reported
as "N rows at C positions"). Outputs of a graph are overwritten by its next replay: Target.forward
returns copies. Under `auto`, where the compiled one-row pass is not kept, the target goes back to the
position-indexed cache (eager passes over a whole capacity would only cost more). On a CPU the same fixed-capacity passes measured
no faster than the symbolic-length ones at a 512-position capacity, and 1.9x slower at 2048 (attention
over the whole capacity; `benchmarks/results/issue19_engine/fixed_vs_dynamic_avx512.txt`,
`pass_latency_cpu_avx512.json`), so a CPU keeps the position-indexed cache (`Target(fixed_cache=True)`
asks for the other anywhere; the tests run it on a CPU).

Guards: dynamo checks ~5,000 guards (model, cache, arguments) before every call of a compiled function,
~2 ms of a 32 ms one-row pass on a 2-core CPU. Symbolic-length graphs evaluate a pass key's guards in
full on its first call only, then skip those on the model's parameters, modules and config
(CompiledPasses.run); static-shape graphs keep them all.

Drafters: the block-diffusion and conditioned drafters follow the target's mode for their own steady-state
pass (drafters/compile_choice.py).

Exactness: a compiled pass computes the same sums with other (fused) kernels, so its logits may differ
from eager's in the last bits (2e-5 measured on SmolLM2 in float32; a padded pass computes its rows
with the kernels of its bucket's row count, a difference of the same order). With `on` or `auto`, plain
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

from .defaults import COMPILE_MODES  # noqa: F401 (compiled.COMPILE_MODES as before; the CLI reads it without torch)
from .errors import DiffspecError

#: the widths compiled under `on`: a pass runs the smallest that holds it (padded), wider ones run eager.
#: From MKL's GEMM cost per row count (2-core AVX-512 EPYC, benchmarks/results/issue19_engine/
#: gemm_rows_avx512.txt; MKL's blocking favours multiples of 8): a pass's linears cost 38 ms at 8 rows,
#: 51-70 at 9-15 against 58 at 16, 70-83 at 17-23 against 74 at 24, 85-95 at 25-31 against 82 at 32.
WIDTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 16, 24, 32)
#: `auto` keeps the compiled one-row pass only where it timed at least this much faster
AUTO_MARGIN = 0.95
FORMAT = 1

#: a pass as the caller asks it: (rows, all logits?). A compiled pass always returns every layer's
#: hidden states (they exist anyway), so passes that read them (the conditioned drafter's) share its graph.
PassShape = Tuple[int, bool]
#: CompiledPasses.run: a pass key's guards are evaluated on its first call only (symbolic-length graphs)
SKIP_STEADY_GUARDS = True


def bucket(rows: int) -> Optional[int]:
    """The compiled width that holds a pass of `rows` rows, or None past the widest."""
    return next((width for width in WIDTH_BUCKETS if width >= rows), None)


#: fixed-capacity caches are powers of two from cache.FIXED_CAPACITY_MIN: graphs allowed per width
FIXED_CAPACITIES = 8


def wants_fixed_cache(mode: str, device_type: str, requested: Optional[bool] = None) -> bool:
    """Whether a target's cache has a fixed capacity: as `requested`, else on CUDA whenever passes are
    compiled (CUDA graphs need fixed shapes; on a CPU it measured no faster, see the module docstring)."""
    return bool(requested) if requested is not None else (mode != "off" and device_type == "cuda")


def check_compile(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise DiffspecError(f"unknown --compile '{mode}' (choose from: {', '.join(COMPILE_MODES)})")


def check_compilable(config, name: str = "this model") -> None:
    """Compiled passes are built and tested for caches whose every layer is full attention (our
    position-indexed layers); a sliding-window layer's past recording and cropping were not traced
    and checked, so such models are refused by name rather than run untested."""
    from .cache import other_than_full_attention

    other = other_than_full_attention(config)
    if other:
        raise DiffspecError(f"--compile supports models whose attention layers are all full attention; {name} has "
                            f"{', '.join(other)} layers (e.g. Gemma 3's sliding window): use --compile off")


def allow_graphs(count: int) -> None:
    """torch recompiles at most `recompile_limit` (default 8) times per function, then falls back to
    eager for good, silently: allow one graph per shape we compile."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < count:
        dynamo_config.recompile_limit = count


def math_attention():
    """Graphs over the fixed-capacity cache attend to the whole capacity under a mask. In float32, SDPA's
    dispatcher picks the memory-efficient (cutlass) kernel for that, which tiles 64 queries: a pass of one
    row spent 226 us a layer in it, 6.8 of its 8 ms on an H200 (benchmarks/results/issue19_engine/gpu_h200/).
    The math backend, which inductor lowers to two small matmuls and a fused softmax, is what such narrow
    passes want. The backend is fixed when a graph is traced (dynamo does not guard on it: a later call
    under other flags reuses the graph), so every call of a CUDA-graph target's compiled passes, the
    tracing one included, runs under this (CompiledPasses.run). The flags are process-wide: a second
    thread calling SDPA at the same moment would see them too (serve runs one engine thread)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


@dataclass
class CompiledPasses:
    """Which of a target's passes run compiled, and what compiling them cost."""

    mode: str = "off"
    fn: Optional[object] = None                      # torch.compile(model.forward)
    shapes: Optional[set] = None                     # the graph shapes that run (None with `on`: every bucket)
    compile_s: Dict[str, float] = field(default_factory=dict)  # shape -> seconds of its first (compiling) pass
    decision: dict = field(default_factory=dict)     # auto's measurement
    quiet: bool = True
    fixed_shapes: bool = False                       # static shapes over a fixed-capacity cache
    cuda_graphs: bool = False                        # ... replayed as CUDA graphs
    guarded: set = field(default_factory=set)        # pass keys that ran once here with dynamo's guards

    @classmethod
    def build(cls, model: torch.nn.Module, mode: str, quiet: bool = True,
              fixed_shapes: bool = False) -> "CompiledPasses":
        """`fixed_shapes`: the target's cache has a fixed capacity (cache.new_fixed_cache), so every tensor
        of a pass has a static shape: one graph per width (and capacity), compiled with static shapes,
        and on CUDA run as CUDA graphs (inductor's `reduce-overhead`: a pass is one graph launch, where
        eager PyTorch launches hundreds of small kernels). Otherwise the cache length is symbolic
        (`dynamic=True`) and a width's graph serves every context length."""
        check_compile(mode)
        if mode == "off":
            return cls("off", quiet=quiet, fixed_shapes=fixed_shapes)
        check_compilable(model.config)
        allow_graphs(len(WIDTH_BUCKETS) * (FIXED_CAPACITIES + 1) if fixed_shapes else 4 * len(WIDTH_BUCKETS))
        install_output_hooks(model)
        on_cuda = next(model.parameters()).device.type == "cuda"
        cuda_graphs = fixed_shapes and on_cuda
        if fixed_shapes:
            fn = torch.compile(model.forward, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)
        else:
            fn = torch.compile(model.forward, dynamic=True)
        return cls(mode, fn, None if mode == "on" else set(), quiet=quiet, fixed_shapes=fixed_shapes,
                   cuda_graphs=cuda_graphs)

    @property
    def skips_steady_guards(self) -> bool:
        """Symbolic-length graphs (a CPU's): see `run`. Not static shapes: there the cache's capacity is a
        shape, and a request that outgrows it must meet the guards that send it to another graph."""
        return (self.fn is not None and not self.fixed_shapes and SKIP_STEADY_GUARDS
                and hasattr(torch.compiler, "set_stance"))  # torch >= 2.6

    def run(self, key: tuple, **kwargs):
        if self.cuda_graphs:  # see math_attention
            with math_attention():
                return self._run(key, **kwargs)
        return self._run(key, **kwargs)

    def _run(self, key: tuple, **kwargs):
        """The compiled forward on `kwargs`. `key` names what of the call the graph was traced for and may
        change between calls: the width, whether the head runs, the attention implementation and the matmul
        plan installed. A key's first call evaluates all of dynamo's guards (and compiles where no graph
        matches); later calls of a key that ran before use torch's `skip_guard_eval_unsafe` stance, which
        skips the guards that never failed on the model's parameters, modules and config and keeps the
        rest: guards on the other tensors (the cache's buffers, the ids), global state (grad and inference
        mode), symbolic shapes, and every guard that once failed (the width's). ~5000 guards checked in
        full cost 1.5-2 ms of a 32 ms one-row pass on a 2-core CPU. A call that matches no graph under the
        stance raises before running anything; it then runs again with every guard evaluated (and
        compiles: torch._dynamo.reset(), a cache that would have grown inside the graph). What is skipped
        does not change between our calls: the model's weights and modules are fixed once the target is
        built (its kernels and attention are in the key), and sliding-window models are refused
        (check_compilable)."""
        global SKIP_STEADY_GUARDS
        if key in self.guarded:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self.fn(**kwargs)
            except TypeError as e:  # a torch without the stance: guards evaluated on every call
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                SKIP_STEADY_GUARDS = False
            except RuntimeError as e:  # no graph matched: evaluate every guard, compile if need be
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
            self.guarded.discard(key)
        out = self.fn(**kwargs)
        if self.skips_steady_guards:
            self.guarded.add(key)
        return out

    def graph_rows(self, shape: PassShape) -> Optional[int]:
        """The width of the graph a pass of this shape runs (its rows padded up to a bucket), or None:
        eager. Prefills (passes that keep only the last logits) never run compiled, nor passes wider
        than the widest bucket, nor a pass on an empty cache (Target.forward)."""
        rows, logits = shape
        width = bucket(rows)
        if self.fn is None or not logits or width is None:
            return None
        return width if self.shapes is None or (width, logits) in self.shapes else None

    def runs(self, shape: PassShape) -> bool:
        return self.graph_rows(shape) is not None

    @property
    def one_row(self) -> bool:
        """Whether plain decoding's one-row pass runs compiled."""
        return self.runs((1, True))

    def timed_first(self, shape: PassShape, seconds: float, capacity: Optional[int] = None) -> None:
        """Record (and report) the first pass of a shape (at a fixed cache `capacity`, which is part of
        the shape): the one that compiled it."""
        key = f"{shape[0]} rows" + (f" at {capacity} positions" if capacity is not None else "")
        if key in self.compile_s:
            return
        self.compile_s[key] = round(seconds, 2)
        if not self.quiet:
            print(f"diffspec: compiled the target's {key} pass in {seconds:.1f} s", file=sys.stderr, flush=True)

    def describe(self) -> str:
        if self.fn is None:
            return "eager" + (" (fixed-capacity cache)" if self.fixed_shapes else "")
        how = "; CUDA graphs" if self.cuda_graphs else ("; static shapes" if self.fixed_shapes else "")
        if self.shapes is None:
            widths = ", ".join(map(str, WIDTH_BUCKETS))
            return f"compiled (passes of up to {WIDTH_BUCKETS[-1]} rows, padded to {widths}{how})"
        return f"compiled one-row pass{how}" if self.shapes else "eager (auto: compiled one-row pass measured slower)"

    def to_json(self) -> dict:
        return {"mode": self.mode, "runs": self.describe(), "compile_s": dict(self.compile_s),
                "decision": dict(self.decision)}


def install_output_hooks(model: torch.nn.Module) -> None:
    """transformers installs the hooks that collect hidden states on a model's first pass that asks for
    them, under a lock that torch.compile cannot trace (a graph break): install them before compiling,
    with one eager pass of one token that reads them."""
    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
        model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)


def compile_widths(target, context: int = 32) -> None:
    """`--compile on`: compile the pass of every bucket's width now (at start), on a scratch context.
    Leaves the target's cache empty."""
    if not target.compiled.quiet:
        print(f"diffspec: --compile on: compiling the target's passes of {', '.join(map(str, WIDTH_BUCKETS))} rows "
              f"(once per process; minutes on a CPU)", file=sys.stderr, flush=True)
    widest = WIDTH_BUCKETS[-1]
    ids = torch.randint(0, target.vocab_size, (context + widest,), generator=torch.Generator().manual_seed(0))
    target.reset()
    target.reserve(context + widest)
    target.forward(ids[:context], logits=False)
    # CUDA graph trees warm a graph up on its first run and record it on the next: run each width three times
    for width in WIDTH_BUCKETS:
        for _ in range(3 if target.compiled.cuda_graphs else 1):
            target.forward(ids[context:context + width])  # Target.forward records the compile time
            target.truncate(context)
    target.reset()
    target.forward_passes = 0


def decision_path(target):
    from .machine_keys import cache_key, cost_dir, machine_key

    passes = target.compiled
    key = cache_key("compile-auto", FORMAT, machine_key(target.device), str(target.dtype), target.base_fingerprint,
                    torch.__version__, AUTO_MARGIN, *(("fixed", passes.cuda_graphs) if passes.fixed_shapes else ()))
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
        target.forward(ids[context:context + 1]).greedy_tokens()
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
