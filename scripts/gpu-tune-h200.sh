#!/usr/bin/env bash
# How tuned_configs/nvidia-h200.yaml is produced: `fa2tune tune --kernel all --causal both` for each shipped
# head_dim/dtype, two tunes side by side on a 2-GPU host (each with half the cores for compiling); the store merges
# their writes under a file lock. On one GPU, run the lists one after another. An item ending in /short or /medium
# tunes the N <= 1k or 1k < N <= 4k entries (--seqlen-bucket; run it after the item's "all" tune, whose config it
# starts from).
#   bash scripts/gpu-tune-h200.sh TRIALS LOGDIR "GPU0 LIST" "GPU1 LIST"
#   a list item: HEAD_DIM/DTYPE[/KERNEL[/BUCKET[/SEQLENS[/HEADS]]]], BUCKET all|short|medium, SEQLENS e.g.
#   8192,16384 (--seqlens; without it, an "all" item leaves out the lengths bucket entries serve:
#   fa2tune.tune.job.unserved_lengths), HEADS QxKV for grouped-query entries (--heads Q --kv-heads KV, causal only:
#   the models that share K/V heads are decoders), e.g.
#   bash scripts/gpu-tune-h200.sh 16 /tmp "128/bf16 128/fp16 128/bf16/all/short" "64/bf16 64/fp16 64/bf16/all/short"
# A template change stales only its kernel's entries: re-tune that kernel alone, e.g. the dK/dV kernel at 8 trials:
#   bash scripts/gpu-tune-h200.sh 8 /tmp "128/bf16/bwd_dkdv 128/bf16/bwd_dkdv/short" "64/bf16/bwd_dkdv 64/fp16/bwd_dkdv"
# Grouped-query entries of each length bucket at Llama-3-8B's and Llama-3.2-1B's heads, the buckets first in each
# list ("all" is then tuned at 8k + 16k):
#   bash scripts/gpu-tune-h200.sh 16 /tmp "128/bf16/all/short//32x8 128/bf16/all/medium//32x8 128/bf16/all/all//32x8" \
#     "64/bf16/all/short//32x8 64/bf16/all/medium//32x8 64/bf16/all/all//32x8"
# KERNEL decode tunes flash_attn_with_kvcache's kernel (one entry per head dim and dtype; BUCKET and SEQLENS unused):
#   bash scripts/gpu-tune-h200.sh 40 /tmp "128/bf16/decode 128/fp16/decode" "64/bf16/decode 64/fp16/decode"
set -euo pipefail
cd "$(dirname "$0")/.."
trials=$1 logs=$2
jobs=$(( $(nproc) / 2 ))
tune() {  # device, then items to tune one after another
  local device=$1; shift
  for item in "$@"; do
    IFS=/ read -r head_dim dtype kernel bucket seqlens heads <<<"$item"
    ${FA2TUNE:-fa2tune} tune --device "$device" --head-dim "$head_dim" --dtype "$dtype" --kernel "${kernel:-all}" \
      --causal "$([ -n "$heads" ] && echo yes || echo both)" --trials "$trials" --jobs "$jobs" \
      --config-dir tuned_configs --seqlen-bucket "${bucket:-all}" ${seqlens:+--seqlens "$seqlens"} \
      ${heads:+--heads "${heads%x*}" --kv-heads "${heads#*x}"}
  done
}
# shellcheck disable=SC2086  # the lists are meant to split into items
tune cuda:0 $3 >"$logs/tune-gpu0.log" 2>&1 &
# shellcheck disable=SC2086
tune cuda:1 $4 >"$logs/tune-gpu1.log" 2>&1 &
wait
