"""Checks of command-line settings that several subcommands share (generate, serve, profile,
eval-drafter): each refuses a setting by name before any model loads. Here rather than in cli.py so
that the subcommands living in their own modules (server/run.py, profile.py) need not import cli.py,
which imports them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import DiffspecError


def policy_options(args) -> dict:
    """The --policy settings the user gave, for make_policy; one that the chosen policy would not read
    (e.g. --gamma with failfast or auto, --tau with fixed) is refused by name."""
    given = {"gamma": args.gamma, "tau": args.tau, "n": args.n, "n_max": args.n_max,
             "recalibrate": True if getattr(args, "recalibrate", False) else None}
    flags = {"gamma": "--gamma", "tau": "--tau", "n": "--n", "n_max": "--n-max", "recalibrate": "--recalibrate"}
    refuse_unread_settings(args.policy, given, flags)
    options = {k: v for k, v in given.items() if v is not None}
    check_policy_values(options)
    return options


def refuse_unread_settings(policy: str, options: dict, names: Optional[dict] = None) -> None:
    """A setting the named policy would not read (gamma with auto or failfast, tau with fixed, ...) is refused by
    name (`names`: how each is spelt to the user, e.g. the CLI's flags), never ignored. None and False are unset."""
    from .defaults import POLICY_SETTINGS  # no torch: refused before anything heavy loads

    names = names or {}
    ignored = [names.get(k, k) for k, v in options.items() if v is not None and v is not False
               and k not in POLICY_SETTINGS[policy]]
    if ignored:
        raise DiffspecError(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} not apply to the "
                            f"{policy} policy (gamma: fixed; tau, n, n-max: failfast; recalibrate: auto)")


def check_policy_values(options: dict) -> None:
    """The values FixedPolicy and FailFastPolicy would refuse, refused before torch and the model load (the same
    rules as theirs, FailFast's defaults filling in)."""
    from .defaults import FAILFAST_DEFAULTS

    gamma, tau, n, n_max = (options.get(k) for k in ("gamma", "tau", "n", "n_max"))
    if gamma is not None and gamma < 0:
        raise DiffspecError(f"--gamma must be an integer >= 0, got {gamma}")
    if tau is not None and not 0.0 <= tau <= 1.0:  # NaN fails too
        raise DiffspecError(f"--tau (failfast's confidence threshold) must be in [0, 1], got {tau}")
    if n is not None and n < 1:
        raise DiffspecError(f"--n (failfast's window) must be an integer >= 1, got {n}")
    if n is not None or n_max is not None:
        n = FAILFAST_DEFAULTS["n"] if n is None else n
        n_max = FAILFAST_DEFAULTS["n_max"] if n_max is None else n_max
        if n_max < n:
            raise DiffspecError(f"--n-max must be >= --n: got N {n}, N_max {n_max}")


def refuse_sampling_settings_under_greedy(temperature: float, **given) -> None:
    """Settings that shape sampling only (--top-p, --top-k, --seed), refused by name under greedy decoding
    (--temperature 0, the default), where they would be ignored. given: flag -> (value, its unset value)."""
    if temperature != 0:
        return
    named = [flag for flag, (value, unset) in given.items() if value != unset]
    if named:
        raise DiffspecError(f"{', '.join(named)} only shape{'s' if len(named) == 1 else ''} sampling: under greedy "
                            f"decoding (--temperature 0, the default) {'it' if len(named) == 1 else 'they'} would be "
                            f"ignored; set --temperature above 0 to sample, or leave {'it' if len(named) == 1 else 'them'} out")


def check_system_message(model: Optional[str], system: Optional[str], chat: bool) -> None:
    """A system message where the prompt has no place for one (--raw, or a model whose tokenizer has no chat
    template, e.g. Gemma 3 270M base) is refused as Target.encode_prompt refuses it, but from the tokenizer alone,
    before the weights load and the auto policy times this machine (~80 s for Gemma 3 the first time). A hub id is
    left to encode_prompt (reading its tokenizer would reach the network)."""
    if not system:
        return
    from .defaults import DEFAULT_MODEL
    from .errors import refuse_misplaced_system_message

    name = model or DEFAULT_MODEL
    if not chat:  # the tokenizer is not needed to say so
        refuse_misplaced_system_message(None, chat, name, raw_flag=" (--raw)")
    from .models import gguf_file, gguf_text_side, resolve_model_path

    gguf = gguf_file(model)
    if gguf is not None:
        tokenizer, _ = gguf_text_side(gguf, quiet=True)
    else:
        where = Path(resolve_model_path(model))
        if not where.is_dir():
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(where))
    refuse_misplaced_system_message(tokenizer, chat, name)


def check_out_folder(out) -> None:
    """An --out that names a file is refused by name before anything writes into it (a folder, or nothing yet)."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise DiffspecError(f"--out {out} exists and is not a folder")


def _looks_like_path(text: str) -> bool:
    """A drafter argument meant as a file or folder (a hub id owner/name is not one)."""
    return text.startswith(("/", "./", "../", "~", ".\\")) or text in (".", "..") or text.count("/") >= 2 \
        or text.endswith((".gguf", ".safetensors", ".json"))


def check_eval_drafter_spec(spec: str) -> None:
    """Refuse, before any model loads, a drafter argument that cannot name a drafter to evaluate."""
    from .defaults import DRAFTER_NAMES, PRESET_NAMES as PRESETS  # names only: no torch before the checks
    from .hub import looks_like_hub_id

    names = ", ".join(n for n in DRAFTER_NAMES if n != "none")
    if spec == "none":
        raise DiffspecError(f"drafter 'none' drafts nothing: there is nothing to evaluate (choose from: {names})")
    if spec in DRAFTER_NAMES:
        return
    prefix, sep, rest = spec.partition(":")
    if sep and (prefix == "ar" or prefix in PRESETS):
        if not rest:
            raise DiffspecError(f"drafter '{prefix}:' needs a model: {prefix}:PATH")
        if _looks_like_path(rest) and not Path(rest).expanduser().exists():
            raise DiffspecError(f"drafter path not found: {rest}")
        return
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DiffspecError(f"drafter '{spec}' is a file; a drafter PATH is a folder (config.json + model.safetensors)")
        if not (path / "config.json").is_file():
            raise DiffspecError(f"drafter folder {spec} has no config.json (a drafter PATH is a folder with config.json "
                                f"+ model.safetensors)")
        return
    if _looks_like_path(spec):
        raise DiffspecError(f"drafter folder not found: {spec}")
    if not looks_like_hub_id(spec):
        raise DiffspecError(f"unknown drafter '{spec}' (choose from: {names}; a PATH must be an existing folder)")


def check_drafter_spec(spec: str) -> None:
    """A drafter name make_drafter can build (each part of A+B), checked without loading anything (nor torch)."""
    if spec in ("none", "auto"):
        return
    parts = spec.split("+")
    bad = [p for p in parts if p in ("", "none", "auto")] if len(parts) > 1 else []
    if bad:
        raise DiffspecError(f"drafter '{spec}': each part of A+B must be a drafter (not {', '.join(repr(b) for b in bad)})")
    for part in parts:
        check_eval_drafter_spec(part)
