"""Starting the RPC agent under the course's worker names.
RPC pickles functions by reference, so what a worker calls lives here at module level, never in a notebook cell."""

from __future__ import annotations

import os
import re
import warnings

import torch.distributed.rpc as rpc

SERVER = "server"

# init_rpc (TensorPipe backend) builds a private ProcessGroupGloo and hands it to
# dist.all_gather_object to exchange device maps (rpc/backend_registry.py). That object
# is a Backend, not a ProcessGroup, so distributed_c10d warns about an API the *caller*
# uses: torch's own code, not ours, and nothing our code does can avoid it.
BACKEND_AS_PROCESS_GROUP = re.compile(
    r"You are using a Backend <class 'torch\.distributed\.distributed_c10d\.ProcessGroupGloo'> as a ProcessGroup\."
)


def worker_name(rank: int) -> str:
    return SERVER if rank == 0 else f"trainer{rank}"


def _is_torch_internal_backend_notice(record: warnings.WarningMessage) -> bool:
    """Exactly the notice init_rpc triggers inside torch: message, category and file must all match."""
    filename = record.filename.replace(os.sep, "/")
    return (
        record.category is UserWarning
        and bool(BACKEND_AS_PROCESS_GROUP.match(str(record.message)))
        and filename.endswith("torch/distributed/distributed_c10d.py")
    )


def start(
    rank: int, world_size: int, name: str | None = None, timeout_s: float = 60.0, num_worker_threads: int = 16
) -> list[dict[str, str]]:
    """`rpc.init_rpc` under the course's names, hiding only torch's internal Backend notice.

    Every other warning raised during init is shown as usual. Returns one record
    (category, source file, first sentence) per notice hidden, so a caller can see what was dropped.
    """
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=num_worker_threads, rpc_timeout=timeout_s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rpc.init_rpc(name or worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    hidden = []
    for record in caught:
        if _is_torch_internal_backend_notice(record):
            hidden.append(
                {
                    "category": record.category.__name__,
                    "source": "/".join(record.filename.replace(os.sep, "/").split("/")[-3:]),
                    "message": str(record.message).split(". ")[0] + ".",
                }
            )
        else:
            warnings.showwarning(record.message, record.category, record.filename, record.lineno)
    return hidden
