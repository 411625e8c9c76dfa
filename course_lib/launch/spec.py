"""One run described once (RunSpec), the directory the kernel and the ranks share (RunDir), and the backend of N ranks.

RunSpec.create is the one place a request is checked; no torch import here (a rank reads its spec before its pid)."""

from __future__ import annotations

import json
import keyword
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Self

BACKENDS = ("auto", "gloo", "nccl")
# One process group serves CPU and CUDA tensors under NCCL: gloo carries the CPU ones.
NCCL_PROCESS_GROUP = "cpu:gloo,cuda:nccl"


class LaunchError(ValueError):
    """The request cannot run; the message says what to change. Raised before anything starts."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of kernel frames
        return [f"{type(self).__name__}: {self}"]


def available_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu(index: int) -> str:
    """CUDA_VISIBLE_DEVICES of a child seeing only our `index`-th GPU: an inherited list's entry (SLURM) or `index`."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return str(index)
    names = [name.strip() for name in inherited.split(",") if name.strip()]
    if not 0 <= index < len(names):
        raise LaunchError(f"GPU {index} is not among the {len(names)} in CUDA_VISIBLE_DEVICES={inherited!r}")
    return names[index]


def resolve_backend(requested: str = "auto", nproc: int | None = None) -> str:
    """'gloo' or 'nccl' for `requested` with `nproc` ranks per node (None: one); LaunchError if it cannot work."""
    if requested not in BACKENDS:
        raise LaunchError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    if requested == "gloo":
        return "gloo"
    gpus, n = available_gpus(), 1 if nproc is None else nproc
    if requested == "auto":
        return "nccl" if 0 < n <= gpus else "gloo"
    if gpus == 0:
        raise LaunchError("--backend nccl needs CUDA GPUs and this machine has none: use --backend gloo")
    if n > gpus:
        raise LaunchError(
            f"{n} ranks with nccl need {n} GPUs, this node has {gpus}: "
            f"use -n {gpus} or less, or --backend auto (gloo on CPU processes when the ranks do not fit)"
        )
    return "nccl"


def backend_for(nproc: int, requested: str = "auto") -> str:
    """The backend of an `nproc`-rank cell under BACKEND=`requested`: gloo where the GPUs cannot hold `nproc` ranks."""
    return "gloo" if requested == "gloo" else resolve_backend("auto", nproc)


def describe_backend(backend: str, nproc: int, init: bool = True) -> str:
    """One line saying what a run got on a GPU machine ('' without GPUs, where gloo is the only choice)."""
    gpus = available_gpus()
    if not gpus:
        return ""
    if not init:
        seen = "the node's GPUs visible to them" if backend == "nccl" else "GPUs hidden from them"
        return f"--no-init: {nproc} ranks, no process group made for them, {seen} ({gpus} on this node)\n"
    if backend == "nccl":
        return f"backend nccl: {nproc} ranks, one GPU each ({gpus} on this node)\n"
    return f"backend gloo: {nproc} ranks as CPU processes, GPUs hidden from them ({gpus} on this node)\n"


RUN_TIMEOUT_S = 300.0  # wall-clock limit of a whole run, start-up included (a rank that hangs is stopped)


@dataclass(frozen=True)
class RunSpec:
    """A checked request: build it with :meth:`create`; the defaults here are the magic's defaults."""

    nproc: int = 2  # ranks on this node
    backend: str = "auto"  # "gloo" or "nccl" once created
    timeout: float = RUN_TIMEOUT_S  # wall-clock seconds for the whole run, start-up included
    out: tuple[str, ...] = ()  # names whose per-rank values come back
    push: tuple[str, ...] = ()  # names whose notebook values the ranks receive (values travel in push.pt)
    stream: bool = False  # rank output live instead of grouped after the run
    init: bool = True  # the worker creates the process group (and destroys it after the cell)
    max_restarts: int = 0
    nnodes: str | None = None  # torchrun's own: "2" or "1:4"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the ranks

    @classmethod
    def create(cls, **request: Any) -> RunSpec:
        """The checked spec for `request`; LaunchError, naming the flag and what it takes, if it cannot run."""
        unknown = sorted(set(request) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(
                f"no run option {', '.join(unknown)}; the options: {', '.join(f.name for f in fields(cls))}"
            )
        raw = {**asdict(cls()), **request}
        nproc = check_nproc(raw["nproc"])
        node_rank = raw["node_rank"]
        return cls(
            nproc=nproc,
            backend=resolve_backend(str(raw["backend"]), nproc),
            timeout=_seconds(raw["timeout"]),
            out=_names(raw["out"], "--out"),
            push=_names(raw["push"], "--push"),
            stream=bool(raw["stream"]),
            init=bool(raw["init"]),
            max_restarts=_whole(raw["max_restarts"], "--max-restarts", "restarts of the whole group", 0),
            nnodes=_text(raw["nnodes"]),
            node_rank=None if node_rank is None else _whole(node_rank, "--node-rank", "this node's index", 0),
            rdzv_endpoint=_text(raw["rdzv_endpoint"]),
            rdzv_backend=_text(raw["rdzv_backend"]),
            rdzv_id=_text(raw["rdzv_id"]),
            env={str(k): str(v) for k, v in dict(raw["env"] or {}).items()},
        )

    @property
    def multi_node(self) -> bool:
        """Whether torchrun's rendezvous flags were given (else a standalone run on a free port)."""
        return any(v is not None for v in (self.nnodes, self.rdzv_endpoint, self.rdzv_backend, self.rdzv_id))

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0 (nodes of equal size)."""
        return (self.node_rank or 0) * self.nproc

    @property
    def pg_timeout_s(self) -> float:
        """A little under the wall clock, so a stuck collective surfaces as an error naming it rather than as a kill."""
        return max(5.0, self.timeout - 10.0) if self.timeout > 20 else max(1.0, self.timeout * 0.8)

    def write(self, run: RunDir) -> None:
        run.spec.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, run: RunDir) -> RunSpec:
        """The spec the kernel wrote (already checked: not checked again)."""
        data = json.loads(run.spec.read_text())
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}  # json: no tuples
        return cls(**values)


def check_nproc(value: object) -> int:
    """Ranks per node as an int, at least 1."""
    return _whole(value, "-n", "ranks per node", 1, least="1 rank")


def _whole(value: object, flag: str, what: str, minimum: int, least: str | None = None) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise LaunchError(f"{flag} must be a whole number ({what}), got {value!r}") from None
    if number < minimum:
        raise LaunchError(f"{flag} must be at least {least or minimum}, got {number}")
    return number


def _seconds(value: object) -> float:
    try:
        seconds = float(str(value))
    except ValueError:
        raise LaunchError(f"--timeout takes a number of seconds, got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise LaunchError(f"--timeout must be a positive number of seconds, got {value!r}")
    return seconds


def _names(value: str | Iterable[str], flag: str) -> tuple[str, ...]:
    """Comma-separated names ("a,b") or an iterable of names, each a Python variable name."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    for name in filter(None, names):
        if not name.isidentifier() or keyword.iskeyword(name):
            raise LaunchError(f"{flag} takes Python variable names separated by commas; {name!r} is not one")
    return tuple(filter(None, names))


def _text(value: object) -> str | None:
    return None if value is None else str(value)


class RunDir:
    """The files of one run (a cell's, or a session's: SessionDir), named here so kernel and ranks spell no path."""

    PREFIX = "torchrun-cell-"  # of the temporary folder create() makes

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cell = path / "cell.py"
        self.spec = path / "spec.json"
        self.push = path / "push.pt"
        self.logs = path / "logs"
        self.agent_file = path / "agent.json"  # the agent's pid, folder and environment, for forked ranks

    @classmethod
    def create(cls) -> Self:
        return cls(Path(tempfile.mkdtemp(prefix=cls.PREFIX)))  # mkdtemp: mode 0700

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def out(self, rank: int) -> Path:
        return self.path / "out" / f"{rank}.pt"

    def out_files(self) -> list[Path]:
        """Every saved --out file, in rank order."""
        return sorted((self.path / "out").glob("*.pt"), key=lambda p: int(p.stem))

    def attempt(self, index: int) -> Path:
        """The folder of the ranks' markers for restart attempt `index` (TORCHELASTIC_RESTART_COUNT)."""
        return self.path / "ranks" / f"attempt_{index}"

    def pid_file(self, index: int, rank: int) -> Path:
        return self.attempt(index) / f"{rank}.pid"

    def done_file(self, index: int, rank: int) -> Path:
        return self.attempt(index) / f"{rank}.done"

    def local_file(self, index: int, local_rank: int) -> Path:
        return self.attempt(index) / f"local_{local_rank}"

    def attempts(self) -> list[int]:
        """Indices of the attempts whose ranks started, in order."""
        return sorted(attempt_index(d) for d in (self.path / "ranks").glob("attempt_*"))

    def log_attempts(self) -> list[tuple[int, Path]]:
        """(index, folder) of torchrun's log folder of each attempt, in order."""
        return sorted((attempt_index(d), d) for d in self.logs.glob("*/attempt_*"))

    def pid_files(self) -> list[tuple[int, int, Path]]:
        """(attempt, rank, pid file) of every rank that started."""
        return sorted((attempt_index(p.parent), int(p.stem), p) for p in (self.path / "ranks").glob("attempt_*/*.pid"))

    def recorded_pids(self) -> list[tuple[int, int, int]]:
        """(attempt, rank, pid) of every rank that has written its pid, in order."""
        return [(attempt, rank, pid) for attempt, rank, pid, _ in self.recorded_starts()]

    def recorded_starts(self) -> list[tuple[int, int, int, float]]:
        """(attempt, rank, pid, start time) of every rank that has written its pid file ("PID START"), in order."""
        found = []
        for attempt, rank, path in self.pid_files():
            if len(fields := path.read_text().split()) == 2:  # written at once (os.replace): never one field
                found.append((attempt, rank, int(fields[0]), float(fields[1])))
        return found

    def started(self) -> dict[int, float]:
        """{pid: start time} of every rank that recorded its pid: a pid counts only while its start time matches."""
        return {pid: start for _, _, pid, start in self.recorded_starts()}

    def pids(self) -> list[int]:
        """Every recorded rank pid, all attempts."""
        return [pid for _, _, pid in self.recorded_pids()]

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of each rank's latest attempt, in rank order."""
        return dict(sorted({rank: pid for _, rank, pid in self.recorded_pids()}.items()))


def attempt_index(folder: Path) -> int:
    """N from a folder named attempt_N (torchrun's log folders and ours)."""
    return int(folder.name.removeprefix("attempt_"))
