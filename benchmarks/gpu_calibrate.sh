#!/usr/bin/env bash
# On a machine with a GPU: the planner's calibration and regression check (benchmarks/gpu_calibrate.py:
# 9 short training runs on one GPU against `plan`'s predictions, about 6-8 minutes on an H100/H200),
# then the GPU tests (python -m pytest -m gpu, a few minutes more; -rP shows what the passing ones print:
# kernel rates, the MoE layer against its plan). Both run whatever the first does;
# the exit status is non-zero if either failed.
#
# Usage: benchmarks/gpu_calibrate.sh [gpu_calibrate.py's arguments: --only NAME ..., --out DIR, ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

failed=0
python benchmarks/gpu_calibrate.py "$@" || { echo "gpu_calibrate.sh: the calibration failed (exit $?)" >&2; failed=1; }
python -m pytest -m gpu -q -rP || { echo "gpu_calibrate.sh: the GPU tests failed (exit $?)" >&2; failed=1; }
exit "$failed"
