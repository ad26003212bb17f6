"""Target backends: which engine runs the target model.

- `transformers` (target.Target): any transformers causal LM, on CPU or CUDA, in the dtype asked for;
  a GGUF file is dequantized once into a float32 safetensors folder.
- `llama.cpp` (backends.llama_cpp.LlamaCppTarget): a GGUF file run by llama.cpp on the CPU with
  its own quantised kernels. Drafters that read the target's hidden states are refused on it.
- `auto` (the default): llama.cpp for a GGUF target on the CPU when llama-cpp-python is installed,
  speculation on it is exact (`LlamaCppTarget.speculation_exact`: not yet, so today auto means
  transformers) and a one-token step measures faster there than in transformers on this machine
  (timed once per machine and file, cached beside the cost tables); transformers otherwise.

The two backends are different models numerically (llama.cpp multiplies with quantised weights and
quantised activations; transformers with the dequantized float32 weights), so their greedy outputs
may differ; each backend's speculative output equals its own plain decoding.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import torch

from ..errors import DiffspecError

BACKENDS = ("auto", "transformers", "llama.cpp")


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise DiffspecError(f"unknown backend '{name}' (choose from: {', '.join(BACKENDS)})")


def check_backend_settings(backend: str, spec: Optional[str], dtype: torch.dtype, device: str) -> None:
    """Refuse, before any model loads, settings the named backend would not honour."""
    check_backend(backend)
    if backend != "llama.cpp":
        return
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


def load_target(spec: Optional[str] = None, backend: str = "auto", dtype: torch.dtype = torch.float32,
                device: str = "cpu", max_context: Optional[int] = None, quiet: bool = False):
    """Load the target on the chosen backend (see the module docstring for `auto`)."""
    from ..target import Target
    from .llama_cpp import LlamaCppTarget

    check_backend_settings(backend, spec, dtype, device)
    if backend == "auto":
        backend = choose_backend(spec, dtype, device, max_context, quiet)
    if backend == "llama.cpp":
        return LlamaCppTarget.load(spec, max_context=max_context, quiet=quiet)
    return Target.load(spec, dtype=dtype, device=device, max_context=max_context, quiet=quiet)


def step_time(target, context: int = 64, steps: int = 16) -> float:
    """Median seconds of a one-token step after `context` tokens (after two warm-up steps)."""
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


def choose_backend(spec: Optional[str], dtype: torch.dtype, device: str, max_context: Optional[int],
                   quiet: bool = False) -> str:
    """`auto`: llama.cpp when the target is a GGUF file on the CPU in float32, llama-cpp-python is
    installed and its one-token step measured faster than transformers' on this machine (cached)."""
    from ..costs import cache_key, cost_dir, machine_key
    from ..models import gguf_file
    from ..output import write_atomically
    from .llama_cpp import available

    if not str(device).startswith("cpu") or dtype != torch.float32 or not available():
        return "transformers"
    from .llama_cpp import LlamaCppTarget

    if not LlamaCppTarget.speculation_exact:  # never trade exactness for speed: see backends/llama_cpp.py
        return "transformers"
    path = gguf_file(spec)
    if path is None:
        return "transformers"
    st = path.stat()
    key = cache_key("backend", machine_key(torch.device("cpu")), str(path.resolve()), st.st_size, int(st.st_mtime))
    where = cost_dir() / f"backend-{key}.json"
    try:
        return json.loads(where.read_text())["backend"]
    except (OSError, ValueError, KeyError):
        pass
    from ..target import Target
    from .llama_cpp import LlamaCppTarget

    if not quiet:
        print("diffspec: choosing the target backend on this machine (timing a one-token step in transformers and "
              "in llama.cpp, once; cached)", file=sys.stderr, flush=True)
    times = {}
    for name, loader in (("llama.cpp", lambda: LlamaCppTarget.load(spec, max_context=max_context, quiet=quiet)),
                         ("transformers", lambda: Target.load(spec, dtype=dtype, device=device,
                                                              max_context=max_context, quiet=quiet))):
        target = loader()
        times[name] = step_time(target)
        del target
    chosen = min(times, key=times.get)
    write_atomically(where, json.dumps({"backend": chosen, "step_s": times, "file": str(path)}, indent=1))
    if not quiet:
        print(f"diffspec: backend {chosen} (one-token step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
              + ")", file=sys.stderr, flush=True)
    return chosen
