"""A diffspec module as it was at an older commit, loaded beside today's code, so that a benchmark can
time the old and the new version in one process, interleaved.

    from old_code import module_at
    old = module_at("af9a88f", "src/diffspec/training/anchored.py")   # old.AnchoredLoss

Its relative imports are made absolute (they then resolve to today's modules), after any `replace`
pairs (old text, new text) are applied to the source: for names that no longer exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_at(commit: str, path: str, replace: tuple = ()) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{path}"],
                         capture_output=True, text=True, check=True).stdout
    for old, new in replace:
        src = src.replace(old, new)
    package = Path(path).relative_to("src").with_suffix("").parts[:-1]     # ("diffspec", "training")

    def absolute(m: re.Match) -> str:
        base = ".".join(package[: len(package) - len(m.group(2)) + 1] + ((m.group(3),) if m.group(3) else ()))
        return f"{m.group(1)}from {base} import"

    src = re.sub(r"^(\s*)from (\.+)([\w.]*) import", absolute, src, flags=re.M)
    name = f"{Path(path).stem}_at_{commit}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, f"{name}.py", "exec"), mod.__dict__)
    return mod
