#!/usr/bin/env bash
# Before class, on the GPU node or the laptop that will run the course (under a minute): GPUs, driver, torch,
# CUDA and NCCL, each notebook's NPROC and backend, TF32 override variables, HOME and the kernels' sockets, the
# compilers torch.compile needs, float8's tensor cores, and a 2-rank all-reduce's bus bandwidth. Each problem
# comes with what to do; the exit status is 1 when one would break the course.
#   launch/check_node.sh              # everything
#   launch/check_node.sh --no-plan    # without each notebook's NPROC (its setup cells in a kernel)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "check_node.sh: no .venv yet: run 'make .venv/.installed' first (on a cluster, on the login node)" >&2
    exit 1
fi
exec .venv/bin/python -m tools.preflight "$@"
