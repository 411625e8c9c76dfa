"""Rank programs of tests/test_rpc.py. RPC starts its own agent (the launch uses init=False), so each
program calls `rpc_lib.start` and `rpc.shutdown` itself; `tests/test_rpc.py:run_rpc` starts them."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc

from course_lib import rpc as rpc_lib


def parameter_server(rank: int, world_size: int, steps: int) -> dict:
    """Both servers with one trainer per trainer process and with 4 trainers; the notices start hid."""
    hidden = rpc_lib.start(rank, world_size)
    runs = {}
    if rank == 0:
        for n_trainers in sorted({world_size - 1, 4}):
            for mode in ("sync", "async"):
                runs[mode, n_trainers] = rpc_lib.run_parameter_server(mode, n_trainers, world_size, steps=steps)
    rpc.shutdown()
    return {"runs": runs, "hidden": hidden}


def _caught(call, *args, **kwargs) -> tuple[str, str] | None:
    try:
        call(*args, **kwargs)
    except Exception as error:  # the test checks the type: catching all of them is the point
        return type(error).__name__, str(error)
    return None


def errors(rank: int, world_size: int) -> dict:
    """Rank 1 makes every mistake of notebook 12's section 4; every rank calls RPC after shutdown."""
    caught = []
    with rpc_lib.captured_stderr() as log:
        rpc_lib.start(rank, world_size)
        if rank == 1:
            caught.append(_caught(rpc.rpc_sync, "server", rpc_lib.fail, args=("bad value",)))
            caught.append(_caught(lambda: rpc.rpc_async("server", rpc_lib.fail, args=("in a future",)).wait()))
            caught.append(_caught(rpc.rpc_sync, "server", rpc_lib.sleep_then_return, args=(1.0, "late"), timeout=0.2))
            caught.append(_caught(rpc.rpc_sync, "nobody", rpc_lib.who_am_i))
            rpc.rpc_sync("server", rpc_lib.wait_for_slow_call)
        rpc.shutdown()
    caught.append(_caught(rpc.rpc_sync, "server", rpc_lib.who_am_i))
    return {"caught": caught, "server_log": log.getvalue()}


def autograd(rank: int, world_size: int) -> dict:
    """Worker 0 drives one distributed-autograd step of the three-stage model (seed 3, lr 0.5)."""
    rpc_lib.start(rank, world_size, name=f"worker{rank}")
    distributed = None
    if rank == 0:
        torch.manual_seed(3)
        x, y = torch.randn(8, 32), torch.randn(8, 8)
        distributed = rpc_lib.distributed_training_step(world_size, x, y, lr=0.5)
    rpc.shutdown()
    return {"distributed": distributed}
