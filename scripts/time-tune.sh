#!/bin/bash
# Times one `fa2tune tune` from a cold start (fresh Triton cache and config dir), with every output line
# timestamped: how docs/TUNING.md's 1-GPU vs 2-GPU wall times were taken.
#   scripts/time-tune.sh LABEL DEVICES [more fa2tune tune args]    e.g. scripts/time-tune.sh 2gpu cuda:0,cuda:1
# Writes ${OUT:-.}/tune-LABEL.log and appends "LABEL ... wall_s=..." and the winners to ${OUT:-.}/summary.txt.
set -u
label=$1; devices=$2; shift 2
out=${OUT:-.}
here=$(dirname "$0")
rm -rf "/tmp/fa2tune-time-$label"
# Untimed: read torch's and fa2tune's files once, so a fresh machine's first run does not pay the disk reads
# (3 s on the 2×H200 host) that the runs after it do not: the runs compare warm against warm.
python3 -c "import fa2tune.tune.workers"
start=$(date +%s.%N)
TRITON_CACHE_DIR="/tmp/fa2tune-time-$label/triton" python3 -u -m fa2tune tune --device "$devices" --head-dim 128 \
  --config-dir "/tmp/fa2tune-time-$label/configs" "$@" 2>&1 | python3 -u "$here/timestamp_lines.py" > "$out/tune-$label.log"
end=$(date +%s.%N)
echo "$label devices=$devices args=$* wall_s=$(python3 -c "print(f'{$end - $start:.1f}')")" | tee -a "$out/summary.txt"
grep -A4 "kernel causal" "$out/tune-$label.log" | tee -a "$out/summary.txt"
