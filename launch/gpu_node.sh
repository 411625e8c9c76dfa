#!/usr/bin/env bash
# Run the whole course on one GPU node. Each notebook runs at the largest NPROC up to the number of GPUs
# that its own parameter check accepts (05 takes 6 of 8 GPUs: it needs NPROC to divide 12), with
# BACKEND=nccl; its cells of more ranks than GPUs run on CPU processes (params.backend_for). A notebook
# that accepts no NPROC up to the GPUs (08 on 1 GPU: it needs 2 ranks) is skipped, with its reason.
#   launch/gpu_node.sh                 # all notebooks -> build/course-gpu/, summary table at the end
#   launch/gpu_node.sh 03 05           # some notebooks (name prefixes)
#   NPROC=4 launch/gpu_node.sh 03      # force NPROC=4 (a notebook that refuses 4 fails)
#   REFRESH_VENV=1 launch/gpu_node.sh  # reinstall .venv if pyproject.toml changed (needs pip's index)
# Before class, run launch/check_node.sh on the node first: it reports in under a minute what would break here.
set -euo pipefail
cd "$(dirname "$0")/.."
# The venv as `make course` sets it up (on a GPU node pip takes torch's CUDA build). An existing .venv whose
# stamp is only older than pyproject.toml is used as it is: a compute node often has no internet for pip.
if [ -e .venv/.installed ] && [ "${REFRESH_VENV:-0}" != 1 ]; then
    STALE=0
    make --question .venv/.installed || STALE=$?  # 1: the stamp is older than pyproject.toml
    if [ "$STALE" = 1 ]; then
        echo "gpu_node.sh: pyproject.toml is newer than .venv/.installed; running with .venv as it is" \
            "(REFRESH_VENV=1 reinstalls it)" >&2
    fi
else
    make .venv/.installed
fi
GPUS=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
    echo "no CUDA GPU visible (torch.cuda.device_count() == 0): use 'make course' for CPU runs" \
        "(launch/check_node.sh says why torch sees none)" >&2
    exit 1
fi
if [ -n "${NPROC:-}" ]; then
    CHOOSE=(-p NPROC "$NPROC")
else
    CHOOSE=(--nproc-up-to "$GPUS")
fi
exec .venv/bin/python -m tools.runner "${CHOOSE[@]}" -p BACKEND nccl --out build/course-gpu "$@"
