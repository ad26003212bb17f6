#!/bin/bash
# the hinted drafter against the shipped one (and prompt lookup), eval-drafter, 10 prompts a set x 256 tokens, every anchor, block 8
cd "$(git rev-parse --show-toplevel)"
for d in ${DRAFTER:?the hinted drafter folder} conditioned prompt-lookup; do
  n=$(basename $d)
  /usr/bin/time -f "$n %e s" python -m diffspec eval-drafter $d --num-prompts 10 --max-new-tokens 256 --block-size 8 --json --out ${OUT:-.}/eval_$n > ${OUT:-.}/eval_$n.json 2>${OUT:-.}/eval_$n.err
  tail -1 ${OUT:-.}/eval_$n.err
done
