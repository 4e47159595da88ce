#!/usr/bin/env bash
# How tuned_configs/nvidia-h200.yaml is produced: every shipped (head_dim, dtype) with every kernel, causal and not,
# two tunes side by side on a 2-GPU host (d=128 on one GPU, d=64 on the other, each with half the cores for
# compiling). The store merges their writes under a file lock. On one GPU, run them one after another.
#   bash scripts/gpu-tune-h200.sh [TRIALS] [LOGDIR] [DTYPES]      e.g. 16 /tmp "bf16 fp16"
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-16}
logs=${2:-/tmp}
dtypes=${3:-bf16 fp16}
jobs=$(( $(nproc) / 2 ))
tune() {  # device, head dim: every dtype, kernel and mask, one after another
  for dtype in $dtypes; do
    ${FA2TUNE:-fa2tune} tune --device "$1" --head-dim "$2" --dtype "$dtype" --kernel all --causal both \
      --trials "$trials" --jobs "$jobs" --config-dir tuned_configs
  done
}
tune cuda:0 128 >"$logs/tune-gpu0-d128.log" 2>&1 &
tune cuda:1 64 >"$logs/tune-gpu1-d64.log" 2>&1 &
wait
