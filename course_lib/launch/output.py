"""What comes back from the ranks: their output and their --out values (the result types are in failures).

Rank output is read from torchrun's per-rank log files (default: printed after the run, grouped
by rank) or from torchrun's ``--tee`` stream (``stream=True``: live, ``[rank N]`` prefixed).
Either way the kernel prints it, so it reaches the notebook even under nbval, where ipykernel
ignores child-process output.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from course_lib.launch.failures import CELL_NAME, Attempt, RankFailure, failure_from_error_file
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
