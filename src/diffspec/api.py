"""The one-call entry point: `diffspec.generate("prompt")`.

    import diffspec
    result = diffspec.generate("Write a haiku about speed.", drafter="prompt-lookup",
                               policy="failfast", max_new_tokens=64)
    print(result.text, result.mean_accepted_length, result.tokens_per_s)

Engines are built once per (model, drafter, policy, dtype) and reused by later calls.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .defaults import DEFAULT_DRAFTER, DEFAULT_POLICY  # noqa: F401 (api.DEFAULT_* as before)
from .backends import asks_for_transformers, auto_keeps, check_backend_settings, choose_backend, load_target
from .devices import parse_dtype
from .drafter_names import check_drafter_dtype, make_drafter
from .errors import DiffspecError
from .engine import Prompt, SpeculativeEngine
from .policies import LengthPolicy, make_policy
from .types import GenerationResult, SamplingParams


_TARGETS: dict = {}
_ENGINES: dict = {}


def load_engine(model: Optional[str] = None, drafter: Optional[str] = DEFAULT_DRAFTER,
                policy: "str | LengthPolicy" = DEFAULT_POLICY, dtype: str = "float32", device: str = "cpu",
                max_context: Optional[int] = None, quiet: bool = False, drafter_dtype: str = "auto",
                backend: str = "auto", kernels: str = "auto", compile: str = "off", **policy_options) -> SpeculativeEngine:
    """Build an engine from names: model (None = the offline default), drafter, policy.
    `drafter_dtype`: what the conditioned or block-diffusion drafter computes in ('auto' = measured, see
    drafters/dtype_choice.py). `backend`: auto, transformers or llama.cpp (see backends/__init__.py).
    `kernels`: auto, multi-row, stock or q8, the transformers backend's matmul choice (kernels.py).
    `compile`: off, on or auto, the transformers backend's compiled passes (compiled.py)."""
    torch_dtype = parse_dtype(dtype)
    check_drafter_dtype(drafter_dtype)  # before the target loads: a typo fails in milliseconds
    if isinstance(policy, str):
        _check_policy_options(policy, policy_options)
    if max_context is not None and not max_context >= 2:  # 0 meant "the model's" and -1 failed after loading
        raise DiffspecError(f"max_context (--max-context) must be >= 2 (a prompt token and a new one), got {max_context}")
    check_backend_settings(backend, model, torch_dtype, device, kernels, compile)
    engine_key = None
    if isinstance(policy, str):  # a policy object may carry state: such engines are not shared
        engine_key = (model, drafter, policy, dtype, device, max_context, drafter_dtype, backend, kernels, compile,
                      tuple(sorted(policy_options.items())))
        if engine_key in _ENGINES:
            return _ENGINES[engine_key]
    target = None
    if backend == "auto":  # resolved first, so one loaded target serves every engine that resolves alike
        chosen = choose_backend(model, torch_dtype, device, max_context, quiet, drafters=(drafter,),
                                needs_transformers=asks_for_transformers(kernels, compile))
        if chosen == "llama.cpp":
            target = _shared_target(model, dtype, torch_dtype, device, max_context, chosen, quiet, kernels, compile)
            if not auto_keeps(target, (drafter,), quiet):
                target = None
    target = target or _shared_target(model, dtype, torch_dtype, device, max_context,
                                      "transformers" if backend == "auto" else backend, quiet, kernels,
                                      compile)
    combine = policy == "auto" or getattr(policy, "name", None) == "auto"
    drafter_obj = make_drafter(drafter, target, dtype=torch_dtype, device=device, compute_dtype=drafter_dtype,
                               combine=combine)
    options = dict(policy_options)
    if options.get("gamma") is None and drafter_obj is not None:
        options["gamma"] = drafter_obj.default_gamma
    if policy == "auto":
        options["progress"] = not quiet  # the first start on a machine times its costs (~1 min on a CPU): say so
    pol = policy if isinstance(policy, LengthPolicy) else make_policy(policy, **options)
    engine = SpeculativeEngine(target, drafter_obj, pol)
    if engine_key is not None:
        _ENGINES[engine_key] = engine
    return engine


def _check_policy_options(policy: str, options: dict) -> None:
    """As the CLI checks them: a setting the named policy would not read is refused by name, never ignored; values
    as the policies check them."""
    from .cli_options import check_policy_values, refuse_unread_settings
    from .defaults import POLICY_SETTINGS
    from .policies import POLICY_NAMES

    if policy not in POLICY_SETTINGS:
        raise DiffspecError(f"unknown policy '{policy}' (choose from: {', '.join(POLICY_NAMES)})")
    refuse_unread_settings(policy, options)
    check_policy_values(options)


def _shared_target(model, dtype: str, torch_dtype, device: str, max_context, backend: str, quiet: bool,
                   kernels: str, compile: str = "off"):
    """One loaded target per (model, dtype, device, max_context, backend, kernels, compile) in this process."""
    transformers = backend == "transformers"
    key = (model, dtype, device, max_context, backend, kernels if transformers else "auto",
           compile if transformers else "off")
    if key not in _TARGETS:
        _TARGETS[key] = load_target(model, backend=backend, dtype=torch_dtype, device=device, max_context=max_context,
                                    quiet=quiet, kernels=key[-2], compile=key[-1])
    return _TARGETS[key]


def generate(prompt: Prompt, model: Optional[str] = None, drafter: Optional[str] = DEFAULT_DRAFTER,
             policy: "str | LengthPolicy" = DEFAULT_POLICY, max_new_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None, chat: bool = True,
             stop_token_ids: Optional[Sequence[int]] = None, **engine_options) -> GenerationResult:
    """Generate with speculative decoding; the output is exactly the target's (see engine.py)."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    engine = load_engine(model, drafter, policy, **engine_options)
    return engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat,
                           stop_token_ids=stop_token_ids)
