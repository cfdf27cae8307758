#!/usr/bin/env bash
# Set up this checkout: ./setup.sh installs titan_exp (editable) and its Python dependencies;
# ./setup.sh --test also installs what the tests need: pytest, Debian's slurm-wlm and munge for the
# Slurm clusters the tests start (iproute2 for the two-node one's network namespaces), and Debian's
# chromium for the MLflow UI check (as root, with apt-get).
set -euo pipefail
cd "$(dirname "$0")"

extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v chromium >/dev/null \
    || ! command -v ip >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "setup.sh: the tests need slurm-wlm, munge, iproute2 and chromium; install them as root (apt-get install slurm-wlm munge iproute2 chromium)" >&2
      exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 chromium >/dev/null
  fi
fi

# Keep a torch >= 2.13 that is already there (a CUDA build on a GPU machine); otherwise take the
# CPU build 2.13.0, which these machines hold on disk (an open range would pull a multi-GB CUDA build).
if python -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) < (2, 13))" 2>/dev/null; then
  torch_pin=()
else
  torch_pin=("torch==2.13.0")
fi
pip install -q --disable-pip-version-check "${torch_pin[@]}" -e ".${extras}"
# Every process of a job (the launcher, each rank, the MLflow writer) imports titan_exp from this
# checkout: compile it once here, where PYTHONDONTWRITEBYTECODE would have each compile it again
# (~0.25 s a process; Python recompiles any file edited since, in memory).
python -m compileall -q -j 0 titan_exp launchers >/dev/null
