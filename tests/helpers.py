"""Drafters and policies used only by tests."""

from __future__ import annotations

import torch

from diffspec.drafters.base import Drafter, DrafterCapabilities, DraftBuilder
from diffspec.policies import LengthPolicy


class RandomDrafter(Drafter):
    """Drafts uniformly random tokens; with_probs=True hands q = uniform to rejection sampling."""

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0, with_probs: bool = False):
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.with_probs = with_probs
        self.capabilities = DrafterCapabilities(gives_probabilities=with_probs)

    def propose(self, context, policy, limit, sampling, generator):
        builder = DraftBuilder()
        uniform = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for k in builder.increments(policy, limit):
            for _ in range(k):
                tok = int(torch.randint(self.vocab_size, (1,), generator=self.gen))
                builder.add(tok, 1.0 / self.vocab_size, uniform if self.with_probs and not sampling.greedy else None)
        return builder.build(0)


class ScriptedDrafter(Drafter):
    """Drafts a fixed continuation (e.g. the reference output itself) with given confidences."""

    name = "scripted"

    def __init__(self, full_sequence, confidence: float = 1.0):
        self.full = list(full_sequence)
        self.confidence = confidence

    def propose(self, context, policy, limit, sampling, generator):
        builder = DraftBuilder()
        rest = self.full[len(context):]
        for k in builder.increments(policy, limit):
            for tok in rest[len(builder): len(builder) + k]:
                builder.add(tok, self.confidence)
        return builder.build(0)


class AlternatingPolicy(LengthPolicy):
    """Drafts `gamma` tokens in a round and switches speculation off in the next (plan_round -> ()),
    from the first round of each request: rounds 1, 3, 5 .. draft, rounds 2, 4, 6 .. are plain steps."""

    name = "alternating"

    def __init__(self, gamma: int = 3):
        self.gamma = gamma
        self.planned = 0

    def begin_request(self, greedy):
        self.planned = 0

    def plan_round(self, context_len, sources):
        self.planned += 1
        return tuple(sources) if self.planned % 2 else ()

    def next_increment(self, confidences):
        return self.gamma if not confidences else 0


class CliResult:
    """What `subprocess.run(..., capture_output=True, text=True)` returns, for a CLI run in this process."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args) -> CliResult:
    """`python -m diffspec.cli ARGS`, run in this process: `main(argv)` with stdout and stderr captured and its exit
    code. A process per call spent ~3.5 s importing torch and transformers before the CLI read its first argument
    (about 190 of the suite's ~1,510 worker-seconds, on the fastest CPU kind); `test_errors.py` still runs the real
    entry point in a process once. As a process would: warnings are printed to stderr the way the CLI formats them
    (under Python's default filters, not pytest's), transformers' log lines go to the captured stderr too (its
    handler keeps the stream it was made with: pointed at the capture meanwhile), an exception prints its traceback
    and exits 1, and what main() changes process-wide (torch's thread count, the warning format) is put back.
    Not captured: what C code writes to file descriptors 1 and 2 (llama.cpp's logs); no caller asserts on it."""
    import contextlib
    import io
    import logging
    import sys
    import traceback
    import warnings

    from diffspec.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads, formatwarning = torch.get_num_threads(), warnings.formatwarning

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    from transformers.utils import logging as hf_logging

    hf_handlers = [h for h in hf_logging.get_logger().handlers if isinstance(h, logging.StreamHandler)]
    hf_streams = [h.setStream(err) for h in hf_handlers]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()  # a fresh interpreter's filters: pytest's would turn warnings into records
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.showwarning = show
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:  # as the interpreter would: the traceback on stderr, exit 1 (Ctrl-C and pytest's own pass)
            traceback.print_exc()
            code = 1
        finally:
            torch.set_num_threads(threads)
            warnings.formatwarning = formatwarning
            for handler, stream in zip(hf_handlers, hf_streams):
                handler.setStream(stream)
    return CliResult(int(code or 0), out.getvalue(), err.getvalue())
