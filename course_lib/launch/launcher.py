"""Run code on N ranks under the real torchrun, from a notebook or a test; every process is ended before launch returns.

The kernel reads the ranks' output from torchrun's logs or --tee stream, so it reaches the notebook under nbval too."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from course_lib.launch import failures, processes
from course_lib.launch.failures import (
    CELL_NAME,
    Attempt,
    RankFailedError,
    RankFailure,
    RunResult,
    RunTimeoutError,
    failure_from_error_file,
)
from course_lib.launch.spec import RunDir, RunSpec

Write = Callable[[str, str], None]  # write(text, "stdout" | "stderr")

# torchrun's --tee lines, with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE set by processes.agent_env
STREAM_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
# Lines the ranks' libraries print that teach nothing (kept out of the cell).
_NOISE = [
    re.compile(p)
    for p in (
        r"^\[Gloo\] Rank \d+ is connected to",
        r"^USDT:.*SyncActivityProfilerHandler.*profiler_(start|stop)$",  # kineto's trace points, every profile
        r"^\s*$",
    )
]


def print_to_notebook(text: str, stream: str) -> None:
    """The default `write`: the kernel's own stdout or stderr."""
    target = sys.stdout if stream == "stdout" else sys.stderr
    target.write(text)
    target.flush()


def _is_noise(line: str) -> bool:
    return any(p.search(line) for p in _NOISE)


def route(line: str, name: str, stream: bool, write: Write, agent_log: list[str]) -> None:
    """One line from the agent's pipe `name`: a rank's (written live if `stream`), or the agent's own (kept)."""
    match = STREAM_PREFIX.match(line)
    if stream and match:
        text = line[match.end() :]
        if not _is_noise(text):
            write(f"[rank {match.group(1)}] {text}\n", name)
    elif not match:
        agent_log.append(line + "\n")


def _clean(text: str, cell_file: str) -> str:
    lines = [line for line in text.splitlines() if not _is_noise(line)]
    return "\n".join(lines).replace(cell_file, CELL_NAME)


def read_attempts(run: RunDir, spec: RunSpec) -> list[Attempt]:
    """Each attempt's rank output and the exceptions its ranks recorded, earliest error first."""
    return [_read_attempt(index, folder, run, spec) for index, folder in run.log_attempts()]


def _read_attempt(index: int, folder: Path, run: RunDir, spec: RunSpec) -> Attempt:
    attempt = Attempt(index)
    cell_file = str(run.cell)
    stamped: list[tuple[int, RankFailure]] = []
    for local in range(spec.nproc):
        mapping = run.local_file(index, local)
        rank = int(mapping.read_text()) if mapping.exists() else spec.first_rank + local
        rank_dir = folder / str(local)
        for name, store in (("stdout", attempt.stdout), ("stderr", attempt.stderr)):
            log = rank_dir / f"{name}.log"
            if log.exists():
                text = _clean(log.read_text(errors="replace"), cell_file)
                # Python's own "[rankN]: Traceback" echo duplicates the error file: drop it.
                store[rank] = "\n".join(line for line in text.splitlines() if not STREAM_PREFIX.match(line))
        error_file = rank_dir / "error.json"
        if error_file.exists():
            stamped.append((error_file.stat().st_mtime_ns, failure_from_error_file(rank, error_file, cell_file)))
    # Earliest error first: the root cause, before the ranks that lost a peer because of it.
    attempt.failures = [f for _, f in sorted(stamped, key=lambda item: item[0])]
    return attempt


def by_rank(texts: dict[int, str]) -> str:
    """Each rank's text as `[rank R] line` lines, in rank order: how both magics show rank output."""
    return "".join(
        f"[rank {rank}] {line}\n" for rank in sorted(texts) for line in texts[rank].splitlines() if not _is_noise(line)
    )


def emit_grouped(write: Write, attempts: list[Attempt]) -> None:
    """Rank output grouped by rank, in rank order: one block for stdout, one for stderr."""
    blocks: dict[str, list[str]] = {"stdout": [], "stderr": []}
    for attempt in attempts:
        if len(attempts) > 1:
            blocks["stdout"].append(f"--- attempt {attempt.index} ---\n")
        for name in ("stdout", "stderr"):
            blocks[name].append(by_rank(getattr(attempt, name)))
        if len(attempts) > 1 and attempt.failures:
            what = "; ".join(f"rank {f.rank} {f.summary}" for f in attempt.failures[:1])
            blocks["stdout"].append(f"attempt {attempt.index} failed: {what}\n")
    for name, lines in blocks.items():
        if "".join(lines):
            write("".join(lines), name)


def collect_values(run: RunDir, out: tuple[str, ...]) -> dict[str, list[Any]]:
    """Each name's values from this node's ranks, in rank order (all ranks on one node)."""
    import torch

    saved = [torch.load(p, weights_only=False, map_location="cpu") for p in run.out_files()]
    return {name: [s[name] for s in saved] for name in out}


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
    """Run `body` on `nproc` ranks per node (`options`: RunSpec's fields); raise RankFailedError if any rank fails."""
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
            proc, start + spec.timeout, lambda line, name: route(line, name, spec.stream, write, agent_log)
        )
    except BaseException:  # KeyboardInterrupt from the kernel, or anything else: leave nothing behind
        processes.end_run(proc, run)
        write("Interrupted: every process of the run was ended.\n", "stderr")
        raise
    finally:
        killed = len(processes.running(run.started())) if timed_out else 0
        running = failures.running_ranks(run, spec) if timed_out else []
        processes.end_run(proc, run)
    wall = time.monotonic() - start

    attempts = read_attempts(run, spec)
    log = "".join(agent_log)
    if not timed_out:  # on a timeout the launcher itself killed the ranks still running
        failures.add_silent_deaths(attempts, log, run)
    if not spec.stream:
        emit_grouped(write, attempts)
    ok = proc.exitcode == 0 and not timed_out
    values = collect_values(run, spec.out) if ok else {}
    result = RunResult(spec.nproc, spec.backend, attempts, values, wall, log)
    if timed_out:
        raise failures.timeout_error(spec, running, killed)
    if proc.exitcode != 0:
        raise failures.failed_error(proc.exitcode, result, body.splitlines(), spec.max_restarts)
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
