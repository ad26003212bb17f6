"""The methods `diffspec bench` compares, by stable name: the registry.

A method is a registry entry (`MethodDef`): a name, the parameters it accepts with their
defaults, and a builder turning (target, parameter values) into a `Runner` (runners.py: how each
method generates and what it counts). Users pick methods with specs (specs.py) such as `plain`,
`conditioned:gamma=16` or `failfast:tau=0.3,n_max=30`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from ..defaults import FAILFAST_DEFAULTS
from ..errors import DiffspecError
from .runners import DFlashRefRunner, EngineRunner, HFRunner, LlamaCppPeerRunner, Runner




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


def _at_least(name: str, low: int) -> Callable:
    """A check refusing a value below `low` by name at parse time (not from deep inside a drafter after the target
    loaded)."""
    def check(value) -> None:
        if value < low:
            raise DiffspecError(f"parameter {name} must be >= {low}, got {value}")
    return check


def _unit(name: str) -> Callable:
    def check(value) -> None:
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise DiffspecError(f"parameter {name} must be in [0, 1], got {value}")
    return check


_FAILFAST = (Param("tau", float, FAILFAST_DEFAULTS["tau"], "FailFast confidence threshold", check=_unit("tau")),
             Param("n", int, FAILFAST_DEFAULTS["n"], "FailFast window increment N", check=_at_least("n", 1)),
             Param("n_max", int, FAILFAST_DEFAULTS["n_max"], "FailFast maximum draft length", check=_at_least("n_max", 1)))


def _engine_builder(drafter: Optional[str], policy: Optional[str], prefix: str = "",
                    combine: bool = False) -> Callable:
    """A builder for an engine method; `drafter`/`policy` None = read them from the values.
    `prefix` is put before a drafter value that lacks it (ar: drafter=PATH means 'ar:PATH');
    `combine`: drafter `auto` may resolve to a combination (make_drafter's `combine`)."""

    def build(target, values: dict) -> Runner:
        from ..drafters import MaskedDiffusionDrafter, PromptLookupDrafter
        from ..drafter_names import make_drafter, set_compute_dtype
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
FIXED_DRAFTER = {"plain": "none", "llama.cpp": "none", "auto": "auto", "prompt-lookup": "prompt-lookup"}


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


_GAMMA = Param("gamma", int, None, "fixed draft length (default: the drafter's)", check=_at_least("gamma", 0))


def _check_drafter_dtype(value: str) -> None:
    from ..drafter_names import check_drafter_dtype

    check_drafter_dtype(value)


_DRAFTER_DTYPE = Param("drafter_dtype", str, "auto", "what the drafter computes in: auto (timed at load), q8 or a dtype",
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
              (Param("num_tokens", int, 10, "prompt_lookup_num_tokens", check=_at_least("num_tokens", 1)),
               Param("max_ngram", int, 2, "max_matching_ngram_size", check=_at_least("max_ngram", 1))), _hf_builder(True)),
    MethodDef("auto", "the default: auto drafter (prompt-lookup+trained drafter where one ships) + auto policy",
              (_DRAFTER_DTYPE,), _engine_builder("auto", "auto", combine=True)),
    MethodDef("combined", "two drafters A+B, each round the proposal worth more verified; auto policy by default",
              (Param("drafter", str, "prompt-lookup+conditioned", "drafters A+B (the cheap one first)",
                     check=_check_combination), _policy("auto"), _GAMMA) + _FAILFAST + (_DRAFTER_DTYPE,),
              _engine_builder(None, None)),
    MethodDef("prompt-lookup", "our n-gram drafter, FailFast policy by default",
              (_policy("failfast"), _GAMMA) + _FAILFAST +
              (Param("max_ngram", int, 3, check=_at_least("max_ngram", 1)), Param("min_ngram", int, 2, check=_at_least("min_ngram", 1))), _engine_builder("prompt-lookup", None)),
    MethodDef("ar", "an autoregressive draft model (ar:drafter=PATH), fixed gamma by default",
              (_drafter(None), _policy("fixed"), _GAMMA) + _FAILFAST,
              _engine_builder(None, None, prefix="ar:"), required=("drafter",)),
    MethodDef("specdiff", "masked-diffusion drafter, fixed gamma, T denoising steps (SpecDiff)",
              (_drafter("masked-diffusion"), _GAMMA, Param("steps", int, None, "T denoising steps (default: the drafter's)", check=_at_least("steps", 1))),
              _engine_builder(None, "fixed")),
    MethodDef("dllm-fixed", "block-diffusion drafter, fixed gamma",
              (_drafter("block-diffusion"), _GAMMA, _DRAFTER_DTYPE), _engine_builder(None, "fixed")),
    MethodDef("failfast", "block-diffusion drafter + FailFast policy",
              (_drafter("block-diffusion"), _DRAFTER_DTYPE) + _FAILFAST, _engine_builder(None, "failfast")),
    MethodDef("conditioned", "target-conditioned drafter, fixed gamma (default: its block size - 1) by default",
              (_drafter("conditioned"), _policy("fixed"), _GAMMA) + _FAILFAST + (_DRAFTER_DTYPE,),
              _engine_builder(None, None)),
    MethodDef("conditioned-failfast", "target-conditioned drafter + FailFast policy",
              (_drafter("conditioned"), _DRAFTER_DTYPE) + _FAILFAST, _engine_builder(None, "failfast")),
    MethodDef("llama.cpp", "llama.cpp's own plain decoding of the target's GGUF (llama-cpp-python Llama.generate; "
                           "the CPU peer)", (Param("threads", int, None, "threads (default: the target's, else all usable cores)", check=_at_least("threads", 1)),),
              _llama_cpp_builder),
    MethodDef("dflash-ref", "z-lab's reference dflash_generate with the same conditioned drafter's weights "
                            "(optional: pip install --no-deps dflash==0.1.0)",
              (_drafter("conditioned"), Param("block_size", int, None, "the reference's block (default: the drafter's)", check=_at_least("block_size", 2))),
              _dflash_ref_builder),
]}


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
