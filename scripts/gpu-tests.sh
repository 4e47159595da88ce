#!/usr/bin/env bash
# Runs the whole suite on a CUDA machine: the CPU tests then use the GPU (no interpreter), plus tests marked gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu-tests.sh needs a CUDA device")'
exec python3 -m pytest -q -ra "$@" tests
