"""What torchrun starts on each rank of a session: an ipyparallel engine whose id is the rank.

    python -m torch.distributed.run ... --module course_lib.session.engine SESSION_DIR

The engine records its pid, registers with the session's controller under engine id == RANK and
serves cells until the session stops. The kernel then calls :func:`prepare` on every engine, which
joins the process group (launch.runtime.init_distributed) and returns the names each cell sees.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def prepare(backend: str, timeout_s: float) -> dict[str, Any]:
    """Join the process group; the namespace of the rank's cells: torch, dist, rank, world_size, local_rank, device."""
    import torch
    import torch.distributed as dist

    from course_lib.launch.runtime import init_distributed

    ctx = init_distributed(backend, timeout_s=timeout_s)
    return {
        "torch": torch,
        "dist": dist,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "device": ctx.device,
    }


def main(folder: Path) -> None:
    from course_lib.launch.worker import start_rank
    from course_lib.session.processes import START_TIMEOUT_S, SessionDir

    session = SessionDir(folder)
    _, rank, _ = start_rank(session)  # dies with the agent, records its pid as a cell's rank does

    from ipyparallel.engine.app import IPEngine

    IPEngine.launch_instance(
        [
            f"--file={session.engine_file}",
            f"--profile-dir={session.profile}",
            f"--IPEngine.id={rank}",
            "--IPEngine.enable_nanny=False",  # the kernel signals engines by pid: no extra process
            f"--IPEngine.wait_for_url_file={START_TIMEOUT_S}",  # started with the controller, not after it
            "--log-level=WARN",
        ]
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
