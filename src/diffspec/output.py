"""Writing results: files replaced atomically, and matplotlib when it is installed."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path


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
