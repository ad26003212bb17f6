#!/usr/bin/env bash
# AVX2-only EPYC measurements, seventeenth session; run alone.
set -uo pipefail
cd /tmp/m17; export PYTHONPATH=/tmp/m17/src
R=benchmarks/results/issue19_engine/avx2_seventeenth
mkdir -p $R
grep -m1 "model name" /proc/cpuinfo > $R/cpu.txt; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort | uniq -c >> $R/cpu.txt
echo "== profile $(date)"; ( time python -m diffspec profile --backend transformers --recalibrate ) > $R/profile_avx2_transformers.txt 2>&1
echo "== profile llama.cpp $(date)"; ( time python -m diffspec profile --backend llama.cpp ) > $R/profile_avx2_llama_cpp.txt 2>&1
echo "== default generate $(date)"; ( time python -m diffspec generate "Write a Python function that checks whether a number is prime." ) > $R/default_generate.txt 2>&1
echo "== kernel_ab $(date)"; python benchmarks/results/issue19_engine/q8_activations/kernel_ab.py > $R/kernel_ab_avx2.txt 2>&1
echo "== bench generate $(date)"; ( time python -m diffspec bench --backend transformers --kernels auto --dataset all --num-prompts 5 --max-new-tokens 256 \
   --methods hf-generate plain llama.cpp --out $R/bench_avx2_5x256_generate --quiet ) > $R/bench_avx2_5x256_generate.log 2>&1
echo "== bench headline $(date)"; ( time python -m diffspec bench --backend transformers --kernels auto --dataset all --num-prompts 20 --max-new-tokens 256 \
   --methods plain auto prompt-lookup:policy=auto conditioned:policy=auto llama.cpp --out $R/bench_avx2_20x256 --quiet ) > $R/bench_avx2_20x256.log 2>&1
echo "== done $(date)"
