#!/usr/bin/env bash
# Rehearse a two-node job on one machine: two torchrun agents, two ranks each, one job of four ranks,
# meeting through c10d rendezvous on 127.0.0.1. On real nodes run the same line on each node with
# the first node's address as the endpoint.
#   launch/multinode_local.sh job.py
set -euo pipefail
SCRIPT=${1:?usage: launch/multinode_local.sh SCRIPT.py}
cd "$(dirname "$0")/.."
PORT=${PORT:-$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
export OMP_NUM_THREADS=1 TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]: '
for node in 0 1; do
    .venv/bin/torchrun --nnodes 2 --nproc-per-node 2 --rdzv-id local-rehearsal --rdzv-backend c10d \
        --rdzv-endpoint "127.0.0.1:$PORT" --tee 3 "$SCRIPT" &
done
wait
