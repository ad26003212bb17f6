"""Method specs: what the user asks `diffspec bench` to measure. `NAME` or `NAME:key=value,...` names a
registry method (methods.py) with parameter overrides; `--sweep key=v1,v2` expands a method into the
cross product of values (`failfast[tau=0.3,n_max=30]`). Checked against the registry at parse time.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import DiffspecError
from .methods import FIXED_DRAFTER, METHODS, TRANSFORMERS_METHODS, MethodDef
from .runners import EngineRunner




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
    check_policy_settings(definition, params, text)
    given = dict(params)
    for low, high in (("min_ngram", "max_ngram"), ("n", "n_max")):  # pairs, the defaults filling in
        if definition.accepts(low) and definition.accepts(high) and (low in given or high in given):
            lo, hi = given.get(low, definition.param(low).default), given.get(high, definition.param(high).default)
            if lo is not None and hi is not None and lo > hi:
                raise DiffspecError(f"method '{text}': need {low} <= {high}, got {lo} and {hi}")
    for key, value in params:
        if key == "drafter":  # a folder that is not there: now, not after the target loaded and plain ran
            from ..cli_options import check_drafter_spec

            check_drafter_spec(f"ar:{value}" if base == "ar" else str(value))
    name = base if not params else f"{base}:" + ",".join(f"{k}={v}" for k, v in params)
    return MethodSpec(name, base, tuple(params))


def _chosen_policy(definition: MethodDef, params: Sequence[tuple]) -> Optional[str]:
    """The policy a method with these parameters runs (given, or its default); None for a method whose
    policy is fixed in its builder (it takes only that policy's settings)."""
    if not definition.accepts("policy"):
        return None
    return dict(params).get("policy", definition.param("policy").default)


def _reads(definition: MethodDef, params: Sequence[tuple], key: str) -> bool:
    """Whether a run of the method with these parameters reads `key`: it must accept it, and a policy
    setting (gamma, tau, n, n_max) must be one its policy reads."""
    from ..policies import POLICY_SETTINGS

    policy = _chosen_policy(definition, params)
    if not definition.accepts(key) or policy is None:
        return definition.accepts(key)
    return key in POLICY_SETTINGS[policy] or all(key not in keys for keys in POLICY_SETTINGS.values())


def check_policy_settings(definition: MethodDef, params: Sequence[tuple], label: str) -> None:
    """Refuse a setting that the method's policy (given, or its default) would not read, e.g.
    `prompt-lookup:policy=auto,gamma=4` or `conditioned:tau=0.3` (fixed by default): never ignored silently."""
    policy = _chosen_policy(definition, params)
    ignored = [k for k, _ in params if not _reads(definition, params, k)]
    if ignored:
        raise DiffspecError(f"method '{label}': {', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} not apply "
                            f"to the {policy} policy (gamma: fixed; tau, n, n_max: failfast)")


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

    Each method that reads some swept parameters (accepts them, under its policy) becomes the cross product of their values
    (sweep values replace the method's own overrides of the same parameter)."""
    registry = METHODS if registry is None else registry
    parsed = [parse_method(s, registry) for s in specs]
    grid = parse_sweep(sweep)
    for key, _ in grid:
        if not any(_reads(registry[p.method], p.params, key) for p in parsed):
            raise DiffspecError(f"--sweep {key}: none of the methods {', '.join(p.name for p in parsed) or '(none)'} "
                                f"accepts that parameter (under its policy)")
    out = []
    for spec in parsed:
        definition = registry[spec.method]
        axes = [(k, [_convert(definition, k, v) for v in vals]) for k, vals in grid
                if _reads(definition, spec.params, k)]
        if not axes:
            out.append(spec)
            continue
        for combo in itertools.product(*[vals for _, vals in axes]):
            swept = dict(zip([k for k, _ in axes], combo))
            params = tuple((k, v) for k, v in spec.params if k not in swept) + tuple(swept.items())
            label = ",".join(f"{k}={v}" for k, v in swept.items())
            check_policy_settings(definition, params, f"{spec.name}[{label}]")
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


def method_needs(specs: Sequence["MethodSpec"], registry: Optional[dict] = None) -> tuple:
    """(the drafter names the methods will run, whether any runs the transformers model): what
    `--backend auto` weighs for a bench (backends.choose_backend)."""
    registry = METHODS if registry is None else registry
    drafters = []
    for spec in specs:
        values = spec.values(registry)
        drafter = FIXED_DRAFTER.get(spec.method, values.get("drafter"))
        drafters.append(f"ar:{drafter}" if spec.method == "ar" and drafter else drafter)
    return tuple(drafters), any(spec.method in TRANSFORMERS_METHODS for spec in specs)


def build_runner(spec: MethodSpec, target, registry: Optional[dict] = None) -> tuple:
    """(Runner, warnings raised while building it, e.g. 'random weights') - warnings are not shown."""
    registry = METHODS if registry is None else registry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = registry[spec.method].build(target, spec.values(registry))
    engine_notes = runner.engine.notes if isinstance(runner, EngineRunner) else ()  # e.g. a FailFast window wider than the block
    return runner, tuple(str(w.message) for w in caught) + tuple(engine_notes)
