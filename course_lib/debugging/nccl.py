"""NCCL only: an all-reduce that times out, and what each error-handling mode and the flight recorder report.

ProcessGroupNCCL runs collectives asynchronously and a watchdog thread times them out. With
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` the watchdog takes the process down; with
``TORCH_NCCL_BLOCKING_WAIT=1`` the waiting call raises in Python. With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
the watchdog first writes the flight recorder to ``TORCH_FR_DUMP_TEMP_FILE<rank>``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from course_lib.debugging.flight import BUFFER_VARIABLES, FlightRecord, read_flight_records
from course_lib.debugging.logs import rank_lines
from course_lib.launch.failures import RankFailure

# The last rank skips the second all-reduce; the others wait in it until the group's timeout.
STUCK_ALL_REDUCE = """
import time
from datetime import timedelta

group = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))  # process group "1" in the flight recorder
x = torch.ones(4, device=device)
dist.all_reduce(x, group=group)
torch.cuda.synchronize()
if rank == world_size - 1:
    time.sleep(20 * TIMEOUT_S)  # skips the next all-reduce; torchrun ends it when the others fail
else:
    dist.all_reduce(x, group=group)  # never completes
    torch.cuda.synchronize()  # the host waits here, until the watchdog (or a blocking wait) ends it
"""


@dataclass
class NcclTimeout:
    failures: list[RankFailure]  # the launcher's RankFailure of each rank, earliest first
    lines: dict[int, list[str]]  # what each rank printed (stdout and stderr)
    flight: dict[int, FlightRecord]  # the dumps the watchdog wrote on the timeout (group "1")


def nccl_timeout(nproc: int, variables: dict[str, str], timeout_s: int = 10) -> NcclTimeout:
    """Run STUCK_ALL_REDUCE on `nproc` GPUs with `variables` set, the flight recorder dumped on the timeout."""
    from course_lib.launch import RankFailedError, launch

    directory = tempfile.mkdtemp(prefix="nccl-timeout-")
    env = {
        **BUFFER_VARIABLES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{directory}/rank_",
        **variables,
    }
    printed: list[str] = []
    try:
        launch(
            STUCK_ALL_REDUCE,
            nproc,
            backend="nccl",
            push={"TIMEOUT_S": timeout_s},
            env=env,
            stream=True,
            write=lambda text, stream: printed.append(text),
            timeout=12 * timeout_s,
        )
    except RankFailedError as error:
        return NcclTimeout(error.failures, rank_lines(printed), read_flight_records(directory, group="1"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    raise RuntimeError("the stuck all-reduce completed: the last rank was expected to skip it")
