#!/usr/bin/env bash
# Run the whole course on one GPU node: every notebook with one rank per GPU over NCCL.
#   launch/gpu_node.sh                 # all notebooks -> build/course-gpu/, summary table at the end
#   launch/gpu_node.sh 03 05           # some notebooks (name prefixes)
#   NPROC=4 launch/gpu_node.sh         # fewer ranks than GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
make .venv/.installed   # same set-up as `make course`; on a GPU node pip takes torch's CUDA build
GPUS=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
    echo "no CUDA GPU visible (torch.cuda.device_count() == 0): use 'make course' for CPU runs" >&2
    exit 1
fi
NPROC=${NPROC:-$GPUS}
exec .venv/bin/python -m course_lib.launch.runner -p NPROC "$NPROC" -p BACKEND nccl --out build/course-gpu "$@"
