"""The methods `diffspec bench` compares, by stable name, and how each is built and run.

A method is a registry entry (`MethodDef`): a name, the parameters it accepts with their
defaults, and a builder turning (target, parameter values) into a `Runner`. Users pick methods
with specs such as `plain`, `conditioned:gamma=16` or `failfast:tau=0.3,n_max=30`; `--sweep`
expands a method into the cross product of parameter values (`failfast[tau=0.3,n_max=30]`).

Every runner generates from prompt token ids and returns an `Outcome`; what it counts:
- engine methods (`plain`, `auto`, `combined`, `prompt-lookup`, `ar`, `specdiff`, `dllm-fixed`,
  `failfast`, `conditioned`, `conditioned-failfast`): the engine's own statistics (GenerationResult),
  rounds the policy switched speculation off included;
- `dflash-ref`: the DFlash reference package's own loop on the same weights (DFlashRefRunner);
- transformers methods (`hf-generate`, `hf-prompt-lookup`): `model.generate` on the target's HF
  model, target forward passes counted by a forward hook. HF's prefill pass also emits the first
  token, so every pass is a round: mean accepted length = new tokens / target passes (1.0 for
  plain generate, as for the engine's `plain`). Draft/verify split and per-round lists: None;
  speculation-off rounds: 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..devices import synchronize
from ..kernels import stock_kernels
from ..errors import DiffspecError
from ..types import SamplingParams


@dataclass(frozen=True)
class Outcome:
    """One generation of one method on one prompt.

    rounds: (drafted, accepted, emitted) per draft-verify round (engine methods; () for HF); drafted
        counts the tokens verified, so the draft-length histogram is read from these.
    draft_time_s / verify_time_s: None where the method cannot split them (HF methods).
    speculation_off_rounds: rounds in which the policy ran no drafter (a plain step by choice; 0 for
        methods without such a policy).
    """

    token_ids: tuple
    wall_time_s: float
    target_forward_passes: int
    drafter_forward_passes: int
    mean_accepted_length: float
    draft_time_s: Optional[float] = None
    verify_time_s: Optional[float] = None
    rounds: tuple = ()
    finish_reason: Optional[str] = None
    prefill_time_s: Optional[float] = None
    speculation_off_rounds: int = 0


class Runner:
    """Generates for one method. `weights` and `policy` say what ran (recorded in every row); `backend`
    what ran the target. `same_model`: False for a peer running another computation of the model (its
    greedy output may differ from plain's without being a lossless failure: the difference is reported,
    not judged)."""

    weights: str = "target only"
    policy: str = "-"
    backend: str = "transformers"
    same_model: bool = True

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        raise NotImplementedError


sync = synchronize  # wall-clock readings cover queued device work


class EngineRunner(Runner):
    """A SpeculativeEngine (no drafter = plain decoding through the same loop)."""

    def __init__(self, engine):
        self.engine = engine
        self.backend = engine.target.backend
        self.weights = engine.drafter.describe() if engine.drafter is not None else "target only"
        self.policy = engine.policy.describe() if engine.drafter is not None else "-"

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        sync(self.engine.target.device)
        t0 = time.perf_counter()
        r = self.engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens, sampling=sampling)
        sync(self.engine.target.device)
        wall = time.perf_counter() - t0
        return Outcome(token_ids=tuple(r.token_ids), wall_time_s=wall, target_forward_passes=r.target_forward_passes,
                       drafter_forward_passes=r.drafter_forward_passes, mean_accepted_length=r.mean_accepted_length,
                       draft_time_s=r.draft_time_s, verify_time_s=r.verify_time_s,
                       rounds=tuple((s.drafted, s.accepted, s.emitted) for s in r.rounds), finish_reason=r.finish_reason,
                       prefill_time_s=r.prefill_time_s, speculation_off_rounds=r.speculation_off_rounds)


class HFRunner(Runner):
    """transformers `model.generate` on the target's model, with transformers' own kernels (F.linear: what
    users run today); prompt lookup when lookup_tokens > 0. Where the target's one-row steps run another
    matmul kernel (`--kernels auto` on a CPU where it measured faster: kernels.py), plain decoding is
    another computation of the same model: a near-tie may break differently, so the output is compared
    with plain's (the match rate), not judged."""

    def __init__(self, target, lookup_tokens: int = 0, max_ngram: int = 2):
        self.target = target
        plan = getattr(target, "linear_plan", None)
        self.same_model = not (plan is not None and plan.one_row)
        self.lookup_tokens, self.max_ngram = lookup_tokens, max_ngram
        self.weights = "target only" if not lookup_tokens else f"transformers prompt lookup (ngram {max_ngram})"
        self.policy = "-" if not lookup_tokens else f"fixed({lookup_tokens})"

    def _config(self, max_new_tokens: int, sampling: SamplingParams):
        from transformers import GenerationConfig

        stops = sorted(self.target.stop_token_ids)
        tok = self.target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                  pad_token_id=pad if pad is not None else (stops[0] if stops else 0))
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if self.lookup_tokens:
            kw.update(prompt_lookup_num_tokens=self.lookup_tokens, max_matching_ngram_size=self.max_ngram)
        return GenerationConfig(**kw)

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        model = self.target.model
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        config = self._config(max_new_tokens, sampling)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            sync(ids.device)
            t0 = time.perf_counter()
            with torch.inference_mode(), stock_kernels(model):  # transformers as users run it
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            sync(ids.device)
            wall = time.perf_counter() - t0
        finally:
            hook.remove()
        new = tuple(int(t) for t in out[0, ids.shape[1]:].tolist())
        stops = self.target.stop_token_ids
        finish = "stop" if new and new[-1] in stops else "length"
        return Outcome(token_ids=new, wall_time_s=wall, target_forward_passes=calls[0], drafter_forward_passes=0,
                       mean_accepted_length=len(new) / max(1, calls[0]), finish_reason=finish)


class LlamaCppPeerRunner(Runner):
    """llama.cpp's own plain decoding: llama-cpp-python's `Llama.generate` on the target's GGUF file,
    with its own sampler (greedy at temperature 0), its KV cache emptied before every prompt, flash
    attention on (llama.cpp's own default on a CPU, and the backend's setting) and llama.cpp's default
    all-f16 KV cache (the backend keeps K in q8_0 for exactness; a step timed as fast). The peer
    a CPU user would run instead. Its greedy output is compared with plain's but not judged: beside a
    transformers target it is another computation (quantised activations); beside the llama.cpp backend
    it prefills the whole prompt in one pass where the engine leaves the last prompt token to the first
    round, and from 64 prompt tokens on llama.cpp's attention computes those rows another way (tiled),
    so a near-tie can later break differently.

    Counts: target passes = prefill chunks + one per generated token; mean accepted length 1.0."""

    def __init__(self, target, threads: Optional[int] = None):
        from ..backends.llama_cpp import import_llama_cpp, usable_cores
        from ..models import gguf_file

        lib = import_llama_cpp()
        path = getattr(target, "gguf", None) or gguf_file(target.name)
        if path is None:
            raise DiffspecError(f"method 'llama.cpp': target '{target.name}' is not a GGUF file")
        self.threads = threads or getattr(target, "threads", None) or usable_cores()
        from ..backends.llama_cpp import _silence

        _silence(lib)
        self.llm = lib.Llama(str(path), n_ctx=target.max_context, n_batch=512, n_ubatch=512, n_threads=self.threads,
                             n_threads_batch=self.threads, flash_attn=True, verbose=False)
        self.target, self.backend = target, "llama.cpp (its own loop)"
        self.same_model = False  # its own prefill layout and sampler: compared with plain, never judged
        self.weights = f"llama.cpp plain decoding: {Path(path).name}, {self.threads} threads"

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        stops = self.target.stop_token_ids
        kw = dict(temp=0.0, top_k=1) if sampling.greedy else dict(temp=sampling.temperature, top_p=sampling.top_p,
                                                                   top_k=sampling.top_k, min_p=0.0)
        if sampling.seed is not None:
            self.llm.set_seed(sampling.seed)
        new, finish = [], "length"
        t0 = time.perf_counter()
        self.llm.reset()  # no prefix reuse across prompts: every method prefills
        for tok in self.llm.generate(list(prompt_ids), repeat_penalty=1.0, **kw):
            new.append(int(tok))
            if tok in stops:
                finish = "stop"
                break
            if len(new) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        prefill = -(-len(prompt_ids) // 512)
        return Outcome(token_ids=tuple(new), wall_time_s=wall, target_forward_passes=prefill + len(new) - 1,
                       drafter_forward_passes=0, mean_accepted_length=1.0, finish_reason=finish)


class DFlashRefRunner(Runner):
    """z-lab's reference decoding loop, `dflash.model.dflash_generate` (PyPI `dflash` 0.1.0, an
    optional dependency), with the drafter's weights loaded by the reference's own
    `DFlashDraftModel.from_pretrained` in the target's dtype, on the target's HF model. It drafts
    a whole block every round (no length policy; `block_size` overrides the drafter's block, the
    reference's own knob) and verifies it in one target pass.

    What it counts: target and drafter passes by forward hooks; emitted tokens per round from the
    reference's own `acceptance_lengths` (`return_stats=True`, with its CUDA-only timer swapped for
    a device-neutral one during the call); the prefill's first token is in no round, so mean
    accepted length = (new tokens - 1) / rounds, DFlash's own figure. On the CPU, hooks also time
    the draft (drafter pass + its LM-head logits) and the verify passes; None on a GPU, where that
    timing would need synchronising inside the loop.
    """

    def __init__(self, target, spec: str, block_size: Optional[int] = None):
        import tempfile

        from ..dflash_format import reference, reference_folder
        from ..models import _no_progress_bars

        model_class, self._generate = reference()
        self.target = target
        self._scratch = tempfile.TemporaryDirectory(prefix="diffspec-dflash-ref-")
        folder = reference_folder(spec, target, self._scratch.name)
        with _no_progress_bars():
            self.model = model_class.from_pretrained(str(folder), dtype=target.dtype).to(target.device).eval()
        if block_size is not None and block_size < 2:
            raise DiffspecError(f"dflash-ref: block_size must be >= 2, got {block_size}")
        self.block_size = b = block_size or self.model.block_size
        self.weights = (f"dflash reference: {spec} (block {self.model.block_size}, layers {len(self.model.layers)}, "
                        f"target layers {list(self.model.target_layer_ids)})")
        self.policy = f"fixed({b - 1}) (whole block of {b}, reference loop)"
        self._clock = {"target": [], "draft": 0.0, "drafter_passes": 0}
        self._timed = torch.device(target.device).type == "cpu"
        inner = self.model.compute_logits

        def compute_logits(*args, **kwargs):  # the drafts' LM-head logits count as drafting
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self._clock["draft"] += time.perf_counter() - t0
            return out

        self.model.compute_logits = compute_logits

    def _hooks(self) -> list:
        clock, starts = self._clock, {}

        def pre(name):
            return lambda *_: starts.__setitem__(name, time.perf_counter())

        def target_done(*_):
            clock["target"].append(time.perf_counter() - starts["target"])

        def drafter_done(*_):
            clock["draft"] += time.perf_counter() - starts["drafter"]
            clock["drafter_passes"] += 1

        m, d = self.target.model, self.model
        return [m.register_forward_pre_hook(pre("target")), m.register_forward_hook(target_done),
                d.register_forward_pre_hook(pre("drafter")), d.register_forward_hook(drafter_done)]

    def _call(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams):
        """dflash_generate(..., return_stats=True) with its timer made device-neutral for the call."""
        import dflash.model as ref

        device = self.target.device
        stops = sorted(self.target.stop_token_ids) or None
        cuda_time = ref._cuda_time
        ref._cuda_time = lambda: (sync(device), time.perf_counter())[1]
        try:
            return self._generate(self.model, self.target.model, ids, max_new_tokens, stops,
                                  temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                  block_size=self.block_size, return_stats=True)
        finally:
            ref._cuda_time = cuda_time

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        self._clock.update(target=[], draft=0.0, drafter_passes=0)
        hooks = self._hooks()
        try:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            sync(ids.device)
            t0 = time.perf_counter()
            stats = self._call(ids, max_new_tokens, sampling)
            sync(ids.device)
            wall = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        new = tuple(int(t) for t in stats.output_ids[0, ids.shape[1]:].tolist())
        emitted = [int(n) for n in stats.acceptance_lengths]
        rounds, start, end = [], ids.shape[1], ids.shape[1] + max_new_tokens
        for n in emitted:  # the reference drafts min(block, room) - 1 tokens a round
            rounds.append((min(self.block_size, end - start) - 1, max(n - 1, 0), n))
            start += n
        finish = "stop" if new and new[-1] in self.target.stop_token_ids else "length"
        passes = self._clock["target"]
        return Outcome(token_ids=new, wall_time_s=wall, target_forward_passes=len(passes),
                       drafter_forward_passes=self._clock["drafter_passes"],
                       mean_accepted_length=sum(emitted) / len(emitted) if emitted else 1.0,
                       draft_time_s=self._clock["draft"] if self._timed else None,
                       verify_time_s=sum(passes[1:]) if self._timed else None, rounds=tuple(rounds),
                       finish_reason=finish, prefill_time_s=stats.time_to_first_token)


# --- the registry ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    name: str
    type: type          # int, float or str
    default: object     # None = the drafter's own / required (see MethodDef.required)
    help: str = ""
    check: Optional[Callable] = None  # value -> None, raising DiffspecError for a bad value (at parse time)


@dataclass(frozen=True)
class MethodDef:
    """A benchmark method: `build(target, values)` -> Runner, values holding every param."""

    name: str
    description: str
    params: tuple = ()          # of Param
    build: Callable = None      # (target, dict) -> Runner
    required: tuple = ()        # params that must be given (e.g. ar's drafter)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        accepted = ", ".join(p.name for p in self.params) or "none"
        raise DiffspecError(f"method '{self.name}' has no parameter '{name}' (it accepts: {accepted})")

    def accepts(self, name: str) -> bool:
        return any(p.name == name for p in self.params)


_FAILFAST = (Param("tau", float, 0.45, "FailFast confidence threshold"),
             Param("n", int, 10, "FailFast window increment N"), Param("n_max", int, 60, "FailFast maximum draft length"))


def _engine_builder(drafter: Optional[str], policy: Optional[str], prefix: str = "",
                    combine: bool = False) -> Callable:
    """A builder for an engine method; `drafter`/`policy` None = read them from the values.
    `prefix` is put before a drafter value that lacks it (ar: drafter=PATH means 'ar:PATH');
    `combine`: drafter `auto` may resolve to a combination (make_drafter's `combine`)."""

    def build(target, values: dict) -> Runner:
        from ..drafters import MaskedDiffusionDrafter, PromptLookupDrafter, make_drafter, set_compute_dtype
        from ..engine import SpeculativeEngine
        from ..policies import make_policy

        spec = values.get("drafter", drafter)
        if spec is None:
            return EngineRunner(SpeculativeEngine(target, None, make_policy("fixed", gamma=1)))
        if spec == "prompt-lookup":
            d = set_compute_dtype(PromptLookupDrafter(max_ngram=values.get("max_ngram", 3),
                                                      min_ngram=values.get("min_ngram", 2)),
                                  values.get("drafter_dtype"), spec)
        else:
            spec = spec if spec.startswith(prefix) else prefix + spec
            d = make_drafter(spec, target, dtype=target.dtype, device=str(target.device),
                             compute_dtype=values.get("drafter_dtype"), combine=combine)
        if values.get("steps") is not None:
            if not isinstance(d, MaskedDiffusionDrafter):
                raise DiffspecError(f"steps applies to masked-diffusion drafters; {d.describe()} is not one")
            d.config = dataclasses.replace(d.config, steps=values["steps"])
        pol = values.get("policy", policy)
        gamma = values.get("gamma") if values.get("gamma") is not None else d.default_gamma
        options = {k: values[k] for k in ("tau", "n", "n_max") if k in values}
        return EngineRunner(SpeculativeEngine(target, d, make_policy(pol, gamma=gamma, **options)))

    return build


def _hf_builder(lookup: bool) -> Callable:
    def build(target, values: dict) -> Runner:
        _needs_transformers("hf-prompt-lookup" if lookup else "hf-generate", target)
        if not lookup:
            return HFRunner(target)
        if values["num_tokens"] < 1:
            raise DiffspecError("hf-prompt-lookup: num_tokens must be >= 1")
        return HFRunner(target, values["num_tokens"], values["max_ngram"])

    return build


def _needs_transformers(method: str, target) -> None:
    if getattr(target, "backend", "transformers") != "transformers":
        raise DiffspecError(f"method '{method}' runs the target's transformers model; the target runs on the "
                            f"{target.backend} backend (use --backend transformers)")


#: methods that run the target's transformers model itself
TRANSFORMERS_METHODS = ("hf-generate", "hf-prompt-lookup", "dflash-ref")
_FIXED_DRAFTER = {"plain": "none", "llama.cpp": "none", "auto": "auto", "prompt-lookup": "prompt-lookup"}


def method_needs(specs: Sequence["MethodSpec"], registry: Optional[dict] = None) -> tuple:
    """(the drafter names the methods will run, whether any runs the transformers model): what
    `--backend auto` weighs for a bench (backends.choose_backend)."""
    registry = METHODS if registry is None else registry
    drafters = []
    for spec in specs:
        values = spec.values(registry)
        drafter = _FIXED_DRAFTER.get(spec.method, values.get("drafter"))
        drafters.append(f"ar:{drafter}" if spec.method == "ar" and drafter else drafter)
    return tuple(drafters), any(spec.method in TRANSFORMERS_METHODS for spec in specs)


def _dflash_ref_builder(target, values: dict) -> Runner:
    _needs_transformers("dflash-ref", target)
    return DFlashRefRunner(target, values["drafter"], values.get("block_size"))


def _llama_cpp_builder(target, values: dict) -> Runner:
    if values.get("threads") is not None and values["threads"] < 1:
        raise DiffspecError(f"llama.cpp: threads must be >= 1, got {values['threads']}")
    return LlamaCppPeerRunner(target, values.get("threads"))


def _drafter(default: Optional[str]) -> Param:
    return Param("drafter", str, default, "drafter name or folder")


def _check_combination(value: str) -> None:
    names = value.split("+")
    if len(names) < 2 or not all(names):
        raise DiffspecError(f"method 'combined': drafter must name two drafters or more as A+B, e.g. "
                            f"prompt-lookup+conditioned, got '{value}'")


_GAMMA = Param("gamma", int, None, "fixed draft length (default: the drafter's)")


def _check_drafter_dtype(value: str) -> None:
    from ..drafters import check_drafter_dtype

    check_drafter_dtype(value)


_DRAFTER_DTYPE = Param("drafter_dtype", str, "auto", "what the drafter computes in: auto (timed at load) or a dtype",
                       check=_check_drafter_dtype)


def _check_policy(value: str) -> None:
    from ..policies import POLICY_NAMES

    if value not in POLICY_NAMES:
        raise DiffspecError(f"unknown policy '{value}' (choose from: {', '.join(POLICY_NAMES)})")


def _policy(default: str) -> Param:
    return Param("policy", str, default, "auto, fixed or failfast", check=_check_policy)


METHODS: dict = {m.name: m for m in [
    MethodDef("hf-generate", "transformers model.generate on the target's HF model (what users run today)",
              build=_hf_builder(False)),
    MethodDef("plain", "the engine with no drafter (the baseline every speedup divides by)",
              build=_engine_builder(None, "fixed")),
    MethodDef("hf-prompt-lookup", "transformers generate with prompt_lookup_num_tokens",
              (Param("num_tokens", int, 10, "prompt_lookup_num_tokens"),
               Param("max_ngram", int, 2, "max_matching_ngram_size")), _hf_builder(True)),
    MethodDef("auto", "the default: auto drafter (prompt-lookup+trained drafter where one ships) + auto policy",
              (_DRAFTER_DTYPE,), _engine_builder("auto", "auto", combine=True)),
    MethodDef("combined", "two drafters A+B, each round the proposal worth more verified; auto policy by default",
              (Param("drafter", str, "prompt-lookup+conditioned", "drafters A+B (the cheap one first)",
                     check=_check_combination), _policy("auto"), _GAMMA) + _FAILFAST + (_DRAFTER_DTYPE,),
              _engine_builder(None, None)),
    MethodDef("prompt-lookup", "our n-gram drafter, FailFast policy by default",
              (_policy("failfast"), _GAMMA) + _FAILFAST +
              (Param("max_ngram", int, 3), Param("min_ngram", int, 2)), _engine_builder("prompt-lookup", None)),
    MethodDef("ar", "an autoregressive draft model (ar:drafter=PATH), fixed gamma by default",
              (_drafter(None), _policy("fixed"), _GAMMA) + _FAILFAST,
              _engine_builder(None, None, prefix="ar:"), required=("drafter",)),
    MethodDef("specdiff", "masked-diffusion drafter, fixed gamma, T denoising steps (SpecDiff)",
              (_drafter("masked-diffusion"), _GAMMA, Param("steps", int, None, "T denoising steps (default: the drafter's)")),
              _engine_builder(None, "fixed")),
    MethodDef("dllm-fixed", "block-diffusion drafter, fixed gamma",
              (_drafter("block-diffusion"), _GAMMA, _DRAFTER_DTYPE), _engine_builder(None, "fixed")),
    MethodDef("failfast", "block-diffusion drafter + FailFast policy",
              (_drafter("block-diffusion"), _DRAFTER_DTYPE) + _FAILFAST, _engine_builder(None, "failfast")),
    MethodDef("conditioned", "target-conditioned drafter, fixed gamma (default: its block size - 1)",
              (_drafter("conditioned"), _GAMMA, _DRAFTER_DTYPE), _engine_builder(None, "fixed")),
    MethodDef("conditioned-failfast", "target-conditioned drafter + FailFast policy",
              (_drafter("conditioned"), _DRAFTER_DTYPE) + _FAILFAST, _engine_builder(None, "failfast")),
    MethodDef("llama.cpp", "llama.cpp's own plain decoding of the target's GGUF (llama-cpp-python Llama.generate; "
                           "the CPU peer)", (Param("threads", int, None, "threads (default: the target's, else all usable cores)"),),
              _llama_cpp_builder),
    MethodDef("dflash-ref", "z-lab's reference dflash_generate with the same conditioned drafter's weights "
                            "(optional: pip install --no-deps dflash==0.1.0)",
              (_drafter("conditioned"), Param("block_size", int, None, "the reference's block (default: the drafter's)")),
              _dflash_ref_builder),
]}


# --- specs and sweeps ------------------------------------------------------------------------

@dataclass(frozen=True)
class MethodSpec:
    """One configuration to measure: a registry method plus parameter overrides."""

    name: str          # display name, unique in a run: 'failfast', 'conditioned:gamma=16', 'failfast[tau=0.3]'
    method: str        # registry key
    params: tuple = ()  # ((param, value), ...) overrides in the order given

    def values(self, registry: dict) -> dict:
        """Every parameter of the method: defaults, then overrides (None defaults left out)."""
        definition = registry[self.method]
        values = {p.name: p.default for p in definition.params if p.default is not None}
        values.update(dict(self.params))
        return values


def _convert(definition: MethodDef, key: str, text: str):
    p = definition.param(key)
    try:
        value = p.type(text)
    except ValueError:
        kind = {int: "an integer", float: "a number"}.get(p.type, "a string")
        raise DiffspecError(f"method '{definition.name}': parameter {key} must be {kind}, got '{text}'") from None
    if p.check is not None:
        p.check(value)
    return value


def parse_method(text: str, registry: Optional[dict] = None) -> MethodSpec:
    """'NAME' or 'NAME:key=value,key=value' -> MethodSpec, checked against the registry."""
    registry = METHODS if registry is None else registry
    base, _, rest = text.partition(":")
    if base not in registry:
        raise DiffspecError(f"unknown method '{base}' (choose from: {', '.join(registry)}; "
                            f"diffspec bench --list-methods describes them)")
    definition = registry[base]
    params = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise DiffspecError(f"method '{text}': parameters are key=value pairs separated by commas, got '{item}'")
        params.append((key, _convert(definition, key, value)))
    keys = [k for k, _ in params]
    if len(set(keys)) != len(keys):
        raise DiffspecError(f"method '{text}' sets a parameter twice")
    for req in definition.required:
        if req not in keys:
            raise DiffspecError(f"method '{base}' needs {req}=..., e.g. {base}:{req}=PATH")
    name = base if not params else f"{base}:" + ",".join(f"{k}={v}" for k, v in params)
    return MethodSpec(name, base, tuple(params))


def parse_sweep(items: Sequence[str]) -> tuple:
    """['tau=0.3,0.45', 'n_max=30,60'] -> (('tau', ['0.3', '0.45']), ('n_max', ['30', '60']))."""
    out, seen = [], set()
    for item in items:
        key, eq, values = item.partition("=")
        vals = [v for v in values.split(",") if v]
        if not eq or not key or not vals:
            raise DiffspecError(f"--sweep takes PARAM=V1,V2,... got '{item}'")
        if key in seen:
            raise DiffspecError(f"--sweep names {key} twice")
        seen.add(key)
        out.append((key, vals))
    return tuple(out)


def expand_methods(specs: Sequence[str], sweep: Sequence[str] = (), registry: Optional[dict] = None) -> list:
    """Method spec strings (+ sweep) -> unique MethodSpecs, `plain` first (added if missing).

    Each method that accepts some swept parameters becomes the cross product of their values
    (sweep values replace the method's own overrides of the same parameter)."""
    registry = METHODS if registry is None else registry
    parsed = [parse_method(s, registry) for s in specs]
    grid = parse_sweep(sweep)
    for key, _ in grid:
        if not any(registry[p.method].accepts(key) for p in parsed):
            raise DiffspecError(f"--sweep {key}: none of the methods {', '.join(p.name for p in parsed) or '(none)'} "
                                f"accepts that parameter")
    out = []
    for spec in parsed:
        definition = registry[spec.method]
        axes = [(k, [_convert(definition, k, v) for v in vals]) for k, vals in grid if definition.accepts(k)]
        if not axes:
            out.append(spec)
            continue
        for combo in itertools.product(*[vals for _, vals in axes]):
            swept = dict(zip([k for k, _ in axes], combo))
            params = tuple((k, v) for k, v in spec.params if k not in swept) + tuple(swept.items())
            label = ",".join(f"{k}={v}" for k, v in swept.items())
            out.append(MethodSpec(f"{spec.name}[{label}]", spec.method, params))
    names = [s.name for s in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DiffspecError(f"method listed twice: {', '.join(dupes)}")
    if "plain" not in names:
        out.insert(0, MethodSpec("plain", "plain"))
    else:
        out.insert(0, out.pop(names.index("plain")))
    return out


def build_runner(spec: MethodSpec, target, registry: Optional[dict] = None) -> tuple:
    """(Runner, warnings raised while building it, e.g. 'random weights') - warnings are not shown."""
    registry = METHODS if registry is None else registry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = registry[spec.method].build(target, spec.values(registry))
    engine_notes = runner.engine.notes if isinstance(runner, EngineRunner) else ()  # e.g. a FailFast window wider than the block
    return runner, tuple(str(w.message) for w in caught) + tuple(engine_notes)


def list_methods(registry: Optional[dict] = None) -> str:
    """The text of `diffspec bench --list-methods`."""
    registry = METHODS if registry is None else registry
    lines = []
    for m in registry.values():
        lines.append(f"{m.name:22s} {m.description}")
        for p in m.params:
            default = "required" if p.name in m.required else ("drafter's own" if p.default is None else p.default)
            lines.append(f"{'':24s}{p.name}={p.type.__name__} (default {default}){'  ' + p.help if p.help else ''}")
    return "\n".join(lines)
