#!/usr/bin/env bash
# How tuned_configs/nvidia-h200.yaml is produced: `fa2tune tune --kernel all --causal both` for each shipped
# head_dim/dtype, two tunes side by side on a 2-GPU host (each with half the cores for compiling); the store merges
# their writes under a file lock. On one GPU, run the lists one after another. An item ending in /short or /medium
# tunes the N <= 1k or 1k < N <= 4k entries (--seqlen-bucket; run it after the item's "all" tune, whose config it
# starts from).
#   bash scripts/gpu-tune-h200.sh TRIALS LOGDIR "GPU0 LIST" "GPU1 LIST"
#   a list item: HEAD_DIM/DTYPE[/KERNEL[/BUCKET[/SEQLENS]]], BUCKET all|short|medium, SEQLENS e.g. 8192,16384 (--seqlens;
#   without it, an "all" item leaves out the lengths the file's short/medium entries serve: tunejob.unserved_lengths)
#   e.g. bash scripts/gpu-tune-h200.sh 16 /tmp "128/bf16 128/fp16 128/bf16/all/short" "64/bf16 64/fp16 64/bf16/all/short"
# (session 5 re-tuned only the forward, 24 trials, then the short entries: docs/bench/logs/ship-tune-d*-session5.log;
# session 11 the backward, 16 trials: "128/bf16/bwd 128/fp16/bwd 64/bf16/bwd", after which the d=128 bf16 N <= 1k
# backward entries were put back to their Triton configs: docs/PERF.md v11;
# session 16 the forward, 16 trials, then the dK/dV kernel alone, 6 trials: "128/bf16/bwd_dkdv 128/bf16/bwd_dkdv/short
# 128/fp16/bwd_dkdv" "64/bf16/bwd_dkdv 64/bf16/bwd_dkdv/short": docs/PERF.md v16; session 17 the length buckets,
# "64/bf16/fwd/short 64/bf16/fwd/medium" "128/bf16/fwd/short 128/bf16/fwd/medium", then "64/bf16/bwd/medium"
# "128/bf16/bwd/medium" at 8 trials: docs/PERF.md v17; session 18 the dK/dV kernel with dQ fused in, 8 trials:
# "64/bf16/bwd_dkdv 64/bf16/bwd_dkdv/short 64/bf16/bwd_dkdv/medium" "128/bf16/bwd_dkdv 128/bf16/bwd_dkdv/medium
# 64/fp16/bwd_dkdv": docs/PERF.md v18; session 19 "128/bf16/bwd_dkdv/all/8192,16384 128/bf16/bwd_dkdv/medium
# 128/bf16/fwd/all/8192,16384" "128/fp16/bwd_dkdv 64/bf16/fwd/all/8192,16384" at 8 trials, then 128/fp16/bwd_dkdv/short
# and /medium: docs/PERF.md v19; session 20, one GPU, "64/bf16/bwd_dkdv 64/bf16/bwd_dkdv/short 64/bf16/bwd_dkdv/medium
# 64/fp16/bwd_dkdv" at 8 trials, one after another: docs/PERF.md v20)
set -euo pipefail
cd "$(dirname "$0")/.."
trials=$1 logs=$2
jobs=$(( $(nproc) / 2 ))
tune() {  # device, then items to tune one after another
  local device=$1; shift
  for item in "$@"; do
    IFS=/ read -r head_dim dtype kernel bucket seqlens <<<"$item"
    ${FA2TUNE:-fa2tune} tune --device "$device" --head-dim "$head_dim" --dtype "$dtype" --kernel "${kernel:-all}" \
      --causal both --trials "$trials" --jobs "$jobs" --config-dir tuned_configs --seqlen-bucket "${bucket:-all}" \
      ${seqlens:+--seqlens "$seqlens"}
  done
}
# shellcheck disable=SC2086  # the lists are meant to split into items
tune cuda:0 $3 >"$logs/tune-gpu0.log" 2>&1 &
# shellcheck disable=SC2086
tune cuda:1 $4 >"$logs/tune-gpu1.log" 2>&1 &
wait
