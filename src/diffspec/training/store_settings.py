"""A token store's settings and folder, checked before anything heavy loads (no torch here): `diffspec make-data`
refuses bad settings and a folder it cannot write in milliseconds, before torch (~3 s) and the target load.
The store itself is store.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..errors import DiffspecError, positive_int

FORMAT = "diffspec-token-store"
VERSION = 1
MANIFEST = "manifest.json"
# settings a resumed run must share with the run that started the store (they decide what is stored)
RESUME_KEYS = ("max_new_tokens", "max_prompt_tokens", "temperatures", "seed")


@dataclass(frozen=True)
class StoreSettings:
    """What `build_store` is asked for; validated before any model is loaded."""
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    temperatures: tuple = (0.0,)
    seed: int = 0
    batch_size: Union[str, int] = "auto"
    shard_sequences: int = 1024
    max_prompts: Optional[int] = None
    corpus: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        for name in ("max_new_tokens", "max_prompt_tokens", "shard_sequences", "max_prompts"):
            value = getattr(self, name)
            if (value is not None or name != "max_prompts") and (isinstance(value, bool) or not isinstance(value, int)
                                                                 or value < 1):
                raise DiffspecError(f"{_flag(name)} must be a positive integer, got {value!r}")
        if not self.temperatures:
            raise DiffspecError("give at least one temperature (0 = greedy)")
        bad = [t for t in self.temperatures if not (t >= 0 and math.isfinite(t))]
        if bad:
            raise DiffspecError(f"{_flag('temperatures')} must be >= 0 (0 = greedy), got {bad[0]}")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise DiffspecError(f"{_flag('temperatures')} repeat: {list(self.temperatures)}")
        if self.batch_size != "auto" and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                                          or self.batch_size < 1):
            raise DiffspecError(f"{_flag('batch_size')} must be 'auto' or a positive integer, got {self.batch_size!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise DiffspecError(f"{_flag('seed')} must be an integer, got {self.seed!r}")

    def resume_values(self) -> dict:
        """The settings a store records and a resumed run must repeat."""
        return {k: list(getattr(self, k)) if k == "temperatures" else getattr(self, k) for k in RESUME_KEYS}


def _flag(name: str) -> str:
    """A setting's name as the API and the command line spell it."""
    return f"{name} (--{name.replace('_', '-')})"


def check_store_folder(out, settings: StoreSettings) -> None:
    """Refuse, before any model loads, a folder that is neither new, empty nor a store, and a store built with
    other settings (what `build_store` also checks, with the target and the prompts)."""
    out = Path(out).expanduser()
    if (out / MANIFEST).is_file():
        _check_settings(out, read_manifest(out), settings)
    elif out.exists() and (not out.is_dir() or any(not p.name.startswith("shard-") for p in out.iterdir())):
        raise DiffspecError(f"{out} exists and is not a token store: give a new or empty folder")


def _check_settings(out: Path, manifest: dict, settings: StoreSettings) -> None:
    old = manifest.get("settings", {})
    for key, mine in settings.resume_values().items():
        if old.get(key) != mine:
            raise DiffspecError(f"{out} was built with {key}={old.get(key)!r}, this run asks for {mine!r}: "
                                f"resume with the same settings, or write to a new folder")


def parse_batch_size(text: str) -> Union[str, int]:
    """'auto' or a positive integer (command-line text)."""
    if text == "auto":
        return text
    return positive_int(text, f"--batch-size must be 'auto' or a positive integer, got '{text}'")


def read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not path.is_dir() or not file.is_file():
        raise DiffspecError(f"{path} is not a diffspec token store (no {MANIFEST}; make one with diffspec make-data)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DiffspecError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DiffspecError(f"{path} is not a diffspec token store ({MANIFEST} has no format '{FORMAT}')")
    if manifest.get("version") != VERSION:
        raise DiffspecError(f"{path}: token store version {manifest.get('version')} is not supported "
                            f"(this diffspec reads version {VERSION})")
    return manifest


def check_corpus_store_folder(out, max_conversations: Optional[int] = None) -> Path:
    """Refuse, before any model loads, a used folder or a bad conversation count for build_corpus_store. -> the folder."""
    if max_conversations is not None and (isinstance(max_conversations, bool) or max_conversations < 1):
        raise DiffspecError(f"max_conversations (--max-prompts) must be a positive integer, got {max_conversations!r}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DiffspecError(f"{out} exists and is not empty: a corpus store is written in one go, into a new folder")
    return out
