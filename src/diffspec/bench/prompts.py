"""Prompt sets for `diffspec bench`: the packaged sets (diffspec.datasets) and the user's JSONL.

`load_bench_prompts(spec, num_prompts)` -> [BenchPrompt], spec one of `humaneval`, `mtbench`,
`champ`, `all` (the three, in that order), a comma-separated list of those, or a path to a `.jsonl` file: one JSON object per line
with the prompt in "prompt" (or "text", "question", or "turns"[0]) and an optional "id". Blank
lines are skipped; a missing file, a line that is not such an object, or a file with no prompts
is a DiffspecError naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..datasets import SETS, load_prompts
from ..errors import DiffspecError
from ..training.data import iter_jsonl

PROMPT_FIELDS = ("prompt", "text", "question")


@dataclass(frozen=True)
class BenchPrompt:
    dataset: str
    prompt_id: str
    text: str


def _prompt_of(obj: dict) -> Optional[str]:
    for key in PROMPT_FIELDS:
        if isinstance(obj.get(key), str):
            return obj[key]
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    return None


def load_jsonl_prompts(path) -> list:
    """[(id, text)] from a JSONL file (see the module docstring); ids default to 'line{N}'."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DiffspecError(f"prompt file not found: {path}")
    out, seen = [], set()
    for lineno, obj in iter_jsonl(path):
        text = _prompt_of(obj) if isinstance(obj, dict) else None
        if not text or not text.strip():
            raise DiffspecError(f"{path}:{lineno}: expected an object with a non-empty \"prompt\" "
                                f"(or \"text\", \"question\", \"turns\"[0]) field")
        pid = str(obj.get("id", f"line{lineno}"))
        if pid in seen:
            raise DiffspecError(f"{path}:{lineno}: duplicate id '{pid}'")
        seen.add(pid)
        out.append((pid, text))
    if not out:
        raise DiffspecError(f"prompt file {path} has no prompts")
    return out


def load_bench_prompts(spec: str, num_prompts: Optional[int] = None) -> list:
    """The first `num_prompts` prompts (None = all) of each named set, as BenchPrompts."""
    if num_prompts is not None and num_prompts < 1:
        raise DiffspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    if "," in spec:  # several sets or files in one run, each under its own name
        return [p for part in spec.split(",") if part.strip() for p in load_bench_prompts(part.strip(), num_prompts)]
    if spec == "all":
        names = list(SETS)
    elif spec in SETS:
        names = [spec]
    elif spec.endswith(".jsonl") or Path(spec).expanduser().exists():
        rows = load_jsonl_prompts(spec)[:num_prompts]
        return [BenchPrompt(Path(spec).stem, pid, text) for pid, text in rows]
    else:
        raise DiffspecError(f"unknown dataset '{spec}' (choose from: {', '.join(SETS)}, all, or a FILE.jsonl)")
    out = []
    for name in names:
        rows = [(pid, text) for pid, text in load_prompts(name) if text.strip()]
        out.extend(BenchPrompt(name, pid, text) for pid, text in rows[:num_prompts])
    return out
