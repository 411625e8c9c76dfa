#!/usr/bin/env bash
# Rehearse a two-node job on one machine: two torchrun agents, two ranks each, one job of four ranks,
# meeting through c10d rendezvous on 127.0.0.1. On real nodes run the same line on each node with
# the first node's address as the endpoint. On a GPU machine each "node" gets its own half of the GPUs
# (CUDA_VISIBLE_DEVICES), as a real node has its own; with one GPU neither gets one (gloo on CPU).
#   launch/multinode_local.sh job.py
set -euo pipefail
SCRIPT=${1:?usage: launch/multinode_local.sh SCRIPT.py}
cd "$(dirname "$0")/.."
PORT=${PORT:-$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
GPUS=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
# The devices this process may use, by their names in CUDA_VISIBLE_DEVICES when that is set.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a DEVICES <<<"$CUDA_VISIBLE_DEVICES"
else
    DEVICES=()
    for ((i = 0; i < GPUS; i++)); do DEVICES+=("$i"); done
fi
HALF=$((GPUS / 2))
export OMP_NUM_THREADS=1 TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: '
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE  # as the course's agents (processes.agent_env): float32 means float32
AGENTS=()
for node in 0 1; do
    if [ "$GPUS" -gt 0 ]; then
        NODE_GPUS=""  # stays "" with one GPU: neither node takes it
        for ((i = node * HALF; i < (node + 1) * HALF; i++)); do NODE_GPUS+="${NODE_GPUS:+,}${DEVICES[i]}"; done
        export CUDA_VISIBLE_DEVICES=$NODE_GPUS
    fi
    .venv/bin/torchrun --nnodes 2 --nproc-per-node 2 --rdzv-id local-rehearsal --rdzv-backend c10d \
        --rdzv-endpoint "127.0.0.1:$PORT" --tee 3 "$SCRIPT" &
    AGENTS+=($!)
done
STATUS=0
for pid in "${AGENTS[@]}"; do wait "$pid" || STATUS=$?; done  # a failing node fails the rehearsal
exit "$STATUS"
