#!/usr/bin/env bash
# The causal tail on a GPU (docs/PERF.md v31), in one call: its tests and the kernels' around it, then the forward and
# the training call at the grid's causal shapes timed with it and without (pairs alone), interleaved in one process.
# The tables come last. JOBS: pytest-xdist workers (default 16; 0 runs them in one process).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu-causal-tail.sh needs a CUDA device")' || exit 1
workers=()
if [ "${JOBS:-16}" != 0 ]; then workers=(-n "${JOBS:-16}"); fi
start=$(date +%s)
python3 -m pytest -q "${workers[@]}" -p no:cacheprovider tests/test_gpu.py \
    -k "with_a_tail or warpspec_forward_matches or warpspec_backward_matches or split_tail or length_bucket or graph" \
    2>&1 | tail -12
echo "tests: $(( $(date +%s) - start )) s"
shapes=128:512:causal,128:1024:causal,128:2048:causal,128:4096:causal,128:8192:causal,128:16384:causal
shapes=$shapes,64:512:causal,64:1024:causal,64:2048:causal,64:4096:causal,64:8192:causal,64:16384:causal
# lengths off the grid, where pairs alone leave the most (modelled 10 % at d=128 N=3000 and 5000, 5 % at 12000)
shapes=$shapes,128:3000:causal,128:5000:causal,128:12000:causal,64:3000:causal
python3 scripts/exp_persistent_waves.py --programs sm,tail --rounds "${ROUNDS:-5}" --shapes "$shapes"
python3 scripts/exp_persistent_waves.py --programs sm,tail --rounds "${ROUNDS:-3}" --mode fwd+bwd --shapes "$shapes"
