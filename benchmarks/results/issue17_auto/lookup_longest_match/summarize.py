"""Print the A/B's summary table: python summarize.py ab_longest_match_avx512.json"""
import json
import sys

d = json.load(open(sys.argv[1]))
for ds, s in d["summary"].items():
    print(ds)
    for m, v in s.items():
        print(f"  {m:15s} ratio {v['ratio']:.3f} tok/s {v['tok_s']:7.2f} median {v['per_prompt_ratio_median']:.3f} "
              f"tok/round {v['tokens_per_round']:.3f} drafted/round {v['drafted_per_round']:.2f} "
              f"accepted/drafted {v['accepted_per_drafted']:.3f} passes {v['target_passes_per_prompt']} "
              f"off {v['off_share']} equal {v['all_equal_plain']}")
