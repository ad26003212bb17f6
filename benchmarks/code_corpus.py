"""Write the ShareGPT conversations whose assistant turns hold code (a ``` fence) as a .jsonl corpus.

The domain A/B of issue 16: `diffspec make-data --source corpus --corpus OUT.jsonl` makes a store of
them, and the same training recipe as on the whole corpus then says whether domain-matched data moves
the code tau at a CPU budget. The evaluation sets are dropped by make-data itself, as for any corpus.

    python benchmarks/code_corpus.py /work/runs/code.jsonl
"""

import json
import sys

from diffspec.training.data import load_sharegpt


def has_code(conv: list) -> bool:
    return any(m["role"] == "assistant" and "```" in m["content"] for m in conv)


def main(out: str) -> None:
    convs = load_sharegpt()
    kept = [c for c in convs if has_code(c)]
    with open(out, "w", encoding="utf-8") as f:
        for c in kept:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    print(f"{len(kept)} of {len(convs)} conversations hold a code fence -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
