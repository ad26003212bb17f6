"""diffspec: lossless speculative decoding for autoregressive LMs, drafted by diffusion LMs.

The names below load on first use (PEP 562): `import diffspec` and the command line's parser import neither
torch nor transformers, so `diffspec --help` and a bad argument answer at once; `from diffspec import Target`
loads what it names."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_WHERE = {  # public name -> the module that defines it
    "generate": "api", "load_engine": "api",
    "AutoregressiveDrafter": "drafters", "Drafter": "drafters", "DrafterCapabilities": "drafters",
    "PromptLookupDrafter": "drafters",
    "make_drafter": "drafter_names",
    "GenerationStream": "engine", "SpeculativeEngine": "engine",
    "DiffspecError": "errors",
    "FailFastPolicy": "policies", "FixedPolicy": "policies", "LengthPolicy": "policies", "make_policy": "policies",
    "Target": "target",
    "Draft": "types", "GenerationResult": "types", "RoundStats": "types", "SamplingParams": "types",
}

__all__ = ["generate", "load_engine", "SpeculativeEngine", "GenerationStream", "Target", "Drafter",
           "DrafterCapabilities", "PromptLookupDrafter", "AutoregressiveDrafter", "make_drafter", "LengthPolicy",
           "FixedPolicy", "FailFastPolicy", "make_policy", "SamplingParams", "Draft", "RoundStats",
           "GenerationResult", "DiffspecError"]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value  # looked up once
        return value
    try:  # a submodule (`diffspec.api`), as an eager __init__ made every one it imported an attribute
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
