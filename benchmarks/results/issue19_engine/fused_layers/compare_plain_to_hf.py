"""Plain decoding of a later bench run against the hf-generate outputs of bench_avx512_20x256 (transformers'
generate with F.linear: our kernels do not touch it, so its tokens are the same in any run).

    python compare_plain_to_hf.py bench_avx512_20x256 bench_plain_final"""
import json
import sys

ref_dir, new_dir = sys.argv[1:3]
hf = {(r["dataset"], r["prompt_id"]): r["token_ids"] for r in map(json.loads, open(f"{ref_dir}/results.jsonl"))
      if r["method"] == "hf-generate"}
same_prompts, tokens, prefix = 0, 0, 0
for r in map(json.loads, open(f"{new_dir}/results.jsonl")):
    if r["method"] != "plain":
        continue
    ref, ours = hf[(r["dataset"], r["prompt_id"])], r["token_ids"]
    n = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
    same_prompts += ref == ours
    tokens += len(ours)
    prefix += n
print(f"plain ({new_dir}) vs hf-generate ({ref_dir}): {same_prompts}/{len(hf)} prompts identical; "
      f"{prefix}/{tokens} of plain's tokens before the first difference")
