"""Writing results: files replaced atomically, cache entries filled by one process at a time, and matplotlib when
it is installed."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional, Tuple, TypeVar

T = TypeVar("T")


def write_atomically(path: Path, text: str) -> None:
    """Write a file so that readers see the old contents or the new, never a part (same-folder rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it an ordinary file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock on `path`.lock while filling the cache entry `path`: one process at a time does the
    work (two test workers, or a server and a CLI run, starting on an empty cache; two timings taken at once would
    each be slowed by the other), the others wait, then read what it wrote. Unlocked where no lock can be taken
    (no fcntl, a read-only folder, a file system without locks)."""
    path = Path(path)
    handle = None
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "w")
        fcntl.flock(handle, fcntl.LOCK_EX)
    except (ImportError, OSError):  # (ENOLCK: some network file systems)
        if handle is not None:
            handle.close()
        handle = None
    try:
        yield
    finally:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def read_or_fill(path: Path, read: Callable[[], Optional[T]], fill: Callable[[], T]) -> Tuple[T, bool]:
    """A cache entry's value: `read()` where the entry is there (not None), else `fill()` (which measures it and
    writes it) under `exclusive(path)`, after reading once more: another process may have filled it while this
    one waited. -> (the value, whether it was read)."""
    value = read()
    if value is not None:
        return value, True
    with exclusive(path):
        value = read()
        if value is not None:
            return value, True
        return fill(), False


def try_write_cache(path: Path, text: str, what: str) -> bool:
    """Write a cache file; where the cache folder is read-only, warn once and go on (the answer in
    hand holds for this process). Returns whether it was written."""
    import sys

    try:
        write_atomically(path, text)
        return True
    except OSError as e:
        print(f"diffspec: warning: could not cache {what} in {path} ({e})", file=sys.stderr, flush=True)
        return False


def pyplot_or_warn(skipping: str):
    """matplotlib.pyplot on the Agg backend, or None with a warning naming the file `skipping`."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn(f"matplotlib is not installed: skipping {skipping} (pip install matplotlib)")
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt
