"""Run a piece of code on N ranks under the real torchrun, from a notebook or a test.

:func:`launch` checks the request once (a :class:`~course_lib.launch.spec.RunSpec`), writes the
cell and the spec into a fresh run directory, starts torchrun with the worker on every rank, and
waits. Whatever happens, every process of the run is ended before it returns (processes.py); then
the ranks' output is printed (output.py) and a failing rank becomes an exception naming it (failures.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from course_lib.launch import failures, output, processes
from course_lib.launch.failures import RankFailedError, RunResult, RunTimeoutError
from course_lib.launch.output import Write, print_to_notebook
from course_lib.launch.spec import RunDir, RunSpec

__all__ = [
    "RankFailedError",
    "RunResult",
    "RunTimeoutError",
    "launch",
    "run_cell",
    "standalone_script",
]


def launch(
    body: str,
    nproc: int | str = RunSpec.nproc,
    *,
    push: Mapping[str, Any] | None = None,
    write: Write = print_to_notebook,
    **options: Any,
) -> RunResult:
    """Run `body` on `nproc` ranks per node; raise RankFailedError if any rank fails.

    `push` maps names to values the ranks receive before the body runs. `options` are the other
    fields of RunSpec: backend, timeout, out (names whose values come back as
    ``result.values[name][rank]``), stream, init, max_restarts, nnodes, node_rank, rdzv_endpoint,
    rdzv_backend, rdzv_id, env. `write(text, "stdout" | "stderr")` receives the ranks' output.
    """
    push = dict(push or {})
    spec = RunSpec.create(nproc=nproc, push=tuple(push), **options)
    return run_cell(spec, body, push, write)


def run_cell(
    spec: RunSpec, body: str, push: Mapping[str, Any] | None = None, write: Write = print_to_notebook
) -> RunResult:
    """Run `body` as `spec` describes; `push` holds a value for each of `spec.push`."""
    run = RunDir.create()
    try:
        return _run(spec, run, body, {name: (push or {})[name] for name in spec.push}, write)
    finally:
        run.remove()


def _run(spec: RunSpec, run: RunDir, body: str, push: dict[str, Any], write: Write) -> RunResult:
    import torch

    run.cell.write_text(body)
    spec.write(run)
    if push:
        torch.save(push, run.push)

    agent_log: list[str] = []
    start = time.monotonic()
    proc = processes.start_agent(spec, run)
    timed_out = False
    try:
        timed_out = processes.pump(
            proc, start + spec.timeout, lambda line, name: output.route(line, name, spec.stream, write, agent_log)
        )
    except BaseException:  # KeyboardInterrupt from the kernel, or anything else: leave nothing behind
        processes.end_run(proc, run)
        write("Interrupted: every process of the run was ended.\n", "stderr")
        raise
    finally:
        killed = len(processes.running(run.pids(), run.path)) if timed_out else 0
        running = failures.running_ranks(run, spec) if timed_out else []
        processes.end_run(proc, run)
    wall = time.monotonic() - start

    attempts = output.read_attempts(run, spec)
    log = "".join(agent_log)
    if not timed_out:  # on a timeout the launcher itself killed the ranks still running
        failures.add_silent_deaths(attempts, log, run)
    if not spec.stream:
        output.emit_grouped(write, attempts)
    ok = proc.returncode == 0 and not timed_out
    values = output.collect_values(run, spec.out) if ok else {}
    result = RunResult(spec.nproc, spec.backend, attempts, values, wall, log)
    if timed_out:
        raise failures.timeout_error(spec, running, killed)
    if proc.returncode != 0:
        raise failures.failed_error(proc.returncode, result, body.splitlines(), spec.max_restarts)
    return result


def standalone_script(body: str, *, backend: str = "auto", init: bool = True, nproc: int = 2) -> str:
    """The cell as a script that plain torchrun runs, with what the worker does for it spelled out."""
    head = [
        "# Written by %%torchrun --save. Run it with, for example:",
        f"#   torchrun --standalone --nproc-per-node {nproc} THIS_FILE.py",
        "#   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 THIS_FILE.py",
        "# With --max-restarts, put TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun: a restarted group needs",
        "# a fresh store (runtime.init_distributed).",
    ]
    if not init:  # what every cell sees; the cell creates the process group itself
        head += [
            "import os",
            "",
            "import torch",
            "",
            'rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))',
            "",
        ]
        return "\n".join(head) + "\n" + body.rstrip() + "\n"
    head += [
        "import torch",
        "import torch.distributed as dist",
        "",
        "from course_lib.launch import runtime",
        "",
        f"_ctx = runtime.init_distributed({backend!r})",
        "rank, world_size, local_rank, device = _ctx.rank, _ctx.world_size, _ctx.local_rank, _ctx.device",
        "",
    ]
    return "\n".join(head) + "\n" + body.rstrip() + "\n\nruntime.shutdown()\n"
