"""Target backends: which engine runs the target model.

- `transformers` (target.Target): any transformers causal LM, on CPU or CUDA, in the dtype asked for;
  a GGUF file is dequantized once into a float32 safetensors folder.
- `llama.cpp` (backends.llama_cpp.LlamaCppTarget): a GGUF file run by llama.cpp on the CPU with
  its own quantised kernels. Drafters that read the target's hidden states run on it when named
  (the default drafter leaves them out there: reading hidden states costs every pass).
- `auto` (the default): llama.cpp for a GGUF target on the CPU when llama-cpp-python is installed,
  a one-token step measures faster there than in transformers on this machine (timed once per
  machine and file, cached beside the cost tables: `choose_backend`), and, if anything will be
  drafted, the loaded llama.cpp target's parity probe finds its verify passes exact for this
  machine, file, llama.cpp version, thread count and context size (`LlamaCppTarget.parity_record`,
  its own cache; `load_target` falls back to transformers where it does not; for a drafter that
  may read hidden states (conditioned, or a drafter folder or hub id, whose kind is not known until
  it loads) the probe of passes that read them must pass too). Transformers otherwise.

The two backends are different models numerically (llama.cpp multiplies with quantised weights and
quantised activations; transformers with the dequantized float32 weights), so their greedy outputs
may differ; each backend's speculative output equals its own plain decoding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..defaults import BACKENDS  # noqa: F401 (backends.BACKENDS as before; the CLI reads it without torch)
from ..errors import DiffspecError



def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise DiffspecError(f"unknown backend '{name}' (choose from: {', '.join(BACKENDS)})")


def asks_for_transformers(kernels: str = "auto", compile: str = "off") -> bool:
    """Whether a transformers-only setting was asked for by name: `--backend auto` then decides for
    transformers (such a setting is never silently dropped by choosing llama.cpp)."""
    return kernels != "auto" or compile != "off"


def check_backend_settings(backend: str, spec: Optional[str], dtype: torch.dtype, device: str,
                           kernels: str = "auto", compile: str = "off") -> None:
    """Refuse, before any model loads, settings the named backend would not honour."""
    from ..compiled import check_compile
    from ..kernels import check_kernels

    check_backend(backend)
    check_kernels(kernels)
    check_compile(compile)
    if kernels == "q8":
        from ..kernels import check_q8_settings

        check_q8_settings(device, compile, dtype)
    if backend != "llama.cpp":
        return
    if kernels != "auto":
        raise DiffspecError(f"--kernels {kernels} applies to the transformers backend; llama.cpp runs its own kernels")
    if compile != "off":
        raise DiffspecError(f"--compile {compile} applies to the transformers backend; llama.cpp runs its own compiled code")
    from ..models import gguf_file
    from .llama_cpp import import_llama_cpp

    if not str(device).startswith("cpu"):
        raise DiffspecError(f"the llama.cpp backend runs on the CPU here; --device {device} needs --backend transformers")
    if dtype != torch.float32:
        raise DiffspecError(f"--dtype {str(dtype).replace('torch.', '')} applies to the transformers backend; llama.cpp "
                            f"computes with the GGUF file's own quantisation (leave --dtype at float32)")
    import_llama_cpp()
    if gguf_file(spec) is None:
        raise DiffspecError(f"the llama.cpp backend runs GGUF files; model '{spec}' is not one "
                            f"(give a .gguf path or a registered GGUF model, or use --backend transformers)")


#: drafter names that need only token ids, so any backend can feed them (see TargetBase.check_drafter)
TOKEN_ONLY_DRAFTERS = ("none", "auto", "prompt-lookup", "block-diffusion", "masked-diffusion")


def drafter_needs_hidden_states(spec: Optional[str]) -> bool:
    """From the name alone, before anything loads: True for `conditioned` and for any name whose kind
    is unknown until it loads (a folder, a hub id, a preset); False for token-only drafters, `ar:` models
    and combinations of them."""
    if spec is None:
        return False
    return any(part not in TOKEN_ONLY_DRAFTERS and not part.startswith("ar:") for part in spec.split("+"))


def is_drafting(drafters: Sequence[Optional[str]]) -> bool:
    return any(d not in (None, "none") for d in drafters)


def load_target(spec: Optional[str] = None, backend: str = "auto", dtype: torch.dtype = torch.float32,
                device: str = "cpu", max_context: Optional[int] = None, quiet: bool = False,
                drafters: Sequence[Optional[str]] = ("auto",), needs_transformers: bool = False,
                kernels: str = "auto", compile: str = "off"):
    """Load the target on the chosen backend. For `auto` (see the module docstring): `drafters` are
    the drafter names that will run on it (None or 'none': plain decoding), `needs_transformers` says
    that something will read its transformers model (bench methods hf-generate, dflash-ref).
    `kernels`: the transformers backend's matmul choice (kernels.py); `compile`: its compiled passes
    (compiled.py). The llama.cpp backend refuses either when set."""
    from ..target import Target
    from .llama_cpp import LlamaCppTarget

    check_backend_settings(backend, spec, dtype, device, kernels, compile)
    chosen = backend
    if backend == "auto":
        chosen = choose_backend(spec, dtype, device, max_context, quiet, drafters,
                                needs_transformers or asks_for_transformers(kernels, compile))
    if chosen == "llama.cpp":
        target = LlamaCppTarget.load(spec, max_context=max_context, quiet=quiet)
        if backend != "auto" or auto_keeps(target, drafters, quiet):
            return target
        del target
    return Target.load(spec, dtype=dtype, device=device, max_context=max_context, quiet=quiet, kernels=kernels,
                       compile=compile)


def auto_keeps(target, drafters: Sequence[Optional[str]], quiet: bool = False) -> bool:
    """Whether `auto` keeps a llama.cpp target it chose for speed: yes for plain decoding, and when
    drafting only where its parity probe found verify passes exact (never trade exactness for speed)."""
    if not is_drafting(drafters):
        return True
    reason = "" if target.speculation_exact else target.inexact_reason
    if not reason and any(drafter_needs_hidden_states(d) for d in drafters) and not target.hidden_states_exact:
        reason = f"with hidden states read, {target.hidden_states_inexact_reason}"
    if not reason:
        return True
    if not quiet:
        print(f"diffspec: the target runs in transformers, not llama.cpp, for speculative decoding: {reason}",
              file=sys.stderr, flush=True)
    return False


#: the context `auto` times a one-token step after, and the context size it loads each backend with
#: for that (the timing belongs to the machine and file, not to a request's --max-context)
STEP_CONTEXT, STEP_MAX_CONTEXT = 64, 256


def step_time(target, context: int = STEP_CONTEXT, steps: int = 16) -> float:
    """Median seconds of a one-token step after `context` tokens (after two warm-up steps); the
    context shrinks to what the target's max_context holds."""
    context = max(1, min(context, target.max_context - steps - 2))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (context + steps + 2,), generator=gen)
    target.reset()
    target.forward(ids[:context], logits=False)
    times = []
    for i in range(context, context + steps + 2):
        t0 = time.perf_counter()
        target.forward(ids[i:i + 1])
        times.append(time.perf_counter() - t0)
    target.reset()
    times = sorted(times[2:])
    return times[len(times) // 2]


def backend_record_path(gguf: Path) -> Path:
    """Where `auto` keeps the step times it measured for this GGUF file on this machine."""
    from ..machine_keys import cache_key, cost_dir, machine_key

    st = gguf.stat()
    key = cache_key("backend", machine_key(torch.device("cpu")), str(gguf.resolve()), st.st_size, int(st.st_mtime),
                    STEP_CONTEXT, STEP_MAX_CONTEXT)
    return cost_dir() / f"backend-{key}.json"


def read_step_times(where: Path) -> Optional[dict]:
    """The cached {"llama.cpp": s, "transformers": s}, or None when absent or not that shape."""
    try:
        times = json.loads(where.read_text())["step_s"]
        if all(isinstance(times[k], (int, float)) and times[k] > 0 for k in ("llama.cpp", "transformers")):
            return times
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def choose_backend(spec: Optional[str], dtype: torch.dtype, device: str, max_context: Optional[int],
                   quiet: bool = False, drafters: Sequence[Optional[str]] = ("auto",),
                   needs_transformers: bool = False) -> str:
    """`auto`, before anything loads: llama.cpp when the target is a GGUF file on the CPU in float32,
    llama-cpp-python is installed, nothing needs the transformers model, and its
    one-token step measured faster than transformers' on this machine (once per machine and file,
    cached). Exactness is the loaded target's to answer (`auto_keeps`). `max_context` is accepted
    for the callers' symmetry; the timing does not depend on it."""
    from ..models import gguf_file
    from ..output import read_or_fill, try_write_cache
    from .llama_cpp import available

    if not str(device).startswith("cpu") or dtype != torch.float32 or not available() or needs_transformers:
        return "transformers"
    path = gguf_file(spec)
    if path is None:
        return "transformers"
    where = backend_record_path(path)

    def measured() -> dict:
        from ..target import Target
        from .llama_cpp import LlamaCppTarget

        if not quiet:
            print("diffspec: choosing the target backend on this machine (timing a one-token step in transformers and "
                  "in llama.cpp; once, cached)", file=sys.stderr, flush=True)
        times = {}
        target = LlamaCppTarget.load(spec, max_context=STEP_MAX_CONTEXT, quiet=True)
        times["llama.cpp"] = step_time(target)
        del target
        target = Target.load(spec, dtype=dtype, device=device, max_context=STEP_MAX_CONTEXT, quiet=quiet)
        times["transformers"] = step_time(target)
        del target
        try_write_cache(where, json.dumps({"step_s": times, "file": str(path)}, indent=1), "the backend step times")
        if not quiet:
            print("diffspec: one-token step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()),
                  file=sys.stderr, flush=True)
        return times

    # another process timing the same file: waited for, then its times read
    times = read_or_fill(where, lambda: read_step_times(where), measured)[0]
    return "llama.cpp" if times["llama.cpp"] < times["transformers"] else "transformers"
