#!/usr/bin/env bash
# How tuned_configs/nvidia-h200.yaml is produced: every shipped (head_dim, dtype) with every kernel, causal and not,
# two tunes side by side on a 2-GPU host (one per GPU, each with half the cores for compiling). The store merges
# their writes under a file lock. On one GPU, run the four commands one after another with --device cuda:0.
#   bash scripts/gpu-tune-h200.sh [TRIALS] [LOGDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-20}
logs=${2:-/tmp}
jobs=$(( $(nproc) / 2 ))
tune() {  # device, then head dims and dtypes to tune on it one after another
  local device=$1; shift
  for spec in "$@"; do
    ${FA2TUNE:-fa2tune} tune --device "$device" --head-dim "${spec%/*}" --dtype "${spec#*/}" --kernel all --causal both \
      --trials "$trials" --jobs "$jobs" --config-dir tuned_configs
  done
}
tune cuda:0 128/bf16 128/fp16 >"$logs/tune-gpu0.log" 2>&1 &
tune cuda:1 64/bf16 64/fp16 >"$logs/tune-gpu1.log" 2>&1 &
wait
