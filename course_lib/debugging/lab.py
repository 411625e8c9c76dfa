"""Notebook 14's lab: debug variables, an NCCL timeout per error mode, the step monitor, a profiler trace, figures."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from course_lib.debugging.hang import BUFFER_VARIABLES, FlightRecord, read_flight_records
from course_lib.launch.failures import RankFailure
from course_lib.launch.runtime import synchronize

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# What the debug variables print, filtered out of the ranks' output and made comparable between runs.
#
# ``TORCH_CPP_LOG_LEVEL=INFO`` lets c10d's C++ log through (glog lines: ``[I1201 07:40:52.846 debug.cpp:48] ...``);
# ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds a fingerprint line per collective and the mismatch error;
# ``NCCL_DEBUG=INFO`` makes NCCL print ``host:pid:tid [device] NCCL INFO ...`` lines. Timestamps, ports,
# pointers and pids change from run to run: :func:`sanitize` replaces them, so what is printed can be stored.

_LAUNCHER_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")  # how launch(stream=True) hands over a rank's line


_GLOG = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} [\d:.]+ (?:\d+ )?([\w.]+):\d+\] (.*)$")


_NCCL = re.compile(r"^\S+:\d+:\d+ \[\d+\] (NCCL (?:INFO|WARN) .*)$")


_VARYING = [
    (re.compile(r", TensorDeviceTypes=TensorOptions\(.*?\)\)"), ", ..."),  # the same on every rank: noise
    (re.compile(r" on SocketImpl\(.*\)\.?$"), ""),
    (re.compile(r"(\]|localhost|127\.0\.0\.1|\)):\d{2,5}\b"), r"\1:PORT"),
    (re.compile(r"\(localhost, \d+\)"), "(localhost, PORT)"),
    (re.compile(r"0x[0-9a-f]+"), "0x..."),
]


def rank_lines(chunks: Iterable[str]) -> dict[int, list[str]]:
    """Each rank's lines, from the text that ``launch(..., stream=True, write=...)`` passed to `write`."""
    lines: dict[int, list[str]] = {}
    for chunk in chunks:
        for line in chunk.splitlines():
            if m := _LAUNCHER_LINE.match(line):
                lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


def sanitize(text: str) -> str:
    """The same text with what varies between runs (ports, pointers, socket details) replaced."""
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return text


def c10d_log(lines: Iterable[str]) -> list[tuple[str, str]]:
    """(source file, message) of each C++ log line among `lines`: what TORCH_CPP_LOG_LEVEL lets through."""
    return [(m.group(1), sanitize(m.group(2))) for line in lines if (m := _GLOG.match(line))]


def nccl_log(lines: Iterable[str]) -> list[str]:
    """NCCL's own lines (NCCL_DEBUG=INFO), without the host:pid:thread prefix, pointers replaced."""
    return [sanitize(m.group(1)) for line in lines if (m := _NCCL.match(line))]


# NCCL only: an all-reduce that times out, and what each error-handling mode and the flight recorder report.
#
# ProcessGroupNCCL runs collectives asynchronously and a watchdog thread times them out. With
# ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` the watchdog takes the process down; with
# ``TORCH_NCCL_BLOCKING_WAIT=1`` the waiting call raises in Python. With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
# the watchdog first writes the flight recorder to ``TORCH_FR_DUMP_TEMP_FILE<rank>``.

# The last rank skips the second all-reduce; the others wait in it until the group's timeout.
STUCK_ALL_REDUCE = """
import os
import time
from datetime import timedelta
from pathlib import Path

group = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))  # process group "1" in the flight recorder
x = torch.ones(4, device=device)
dist.all_reduce(x, group=group)
torch.cuda.synchronize()
if rank == world_size - 1:
    time.sleep(20 * TIMEOUT_S)  # skips the next all-reduce; torchrun ends it when the others fail
else:
    try:
        dist.all_reduce(x, group=group)  # never completes
        torch.cuda.synchronize()  # the host waits here, until the watchdog (or a blocking wait) ends it
    finally:
        # Under TORCH_NCCL_BLOCKING_WAIT=1 the timeout raises here, in this thread, while the watchdog's thread
        # writes the flight recorder's dump: the exception would end the process before the dump is whole.
        dump, deadline = Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)), time.monotonic() + 3 * TIMEOUT_S
        while not dump.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the writer's last bytes
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


# Time, throughput and memory per training step, on one rank.


def memory_mb(device: torch.device | str = "cpu") -> float:
    """Memory this rank holds now: CUDA tensors on a GPU, the process's resident set on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


@dataclass
class StepMonitor:
    """Per-step wall time, throughput (samples/s) and memory on one rank."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    memory_mb: list[float] = field(default_factory=list)

    def step(self, samples: int) -> _TimedStep:
        return _TimedStep(self, samples)

    def as_dict(self) -> dict[str, list[float]]:
        return {"seconds": self.seconds, "samples_per_s": self.samples_per_s, "memory_mb": self.memory_mb}


class _TimedStep:
    def __init__(self, monitor: StepMonitor, samples: int):
        self.monitor, self.samples = monitor, samples

    def __enter__(self) -> _TimedStep:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.monitor.device)
        elapsed = time.perf_counter() - self.start
        self.monitor.seconds.append(elapsed)
        self.monitor.samples_per_s.append(self.samples / elapsed)
        self.monitor.memory_mb.append(memory_mb(self.monitor.device))


# What a chrome trace written by torch.profiler holds: event names, and the size of each all-reduce.


def trace_event_names(path: str) -> list[str]:
    """Names of the complete events ("ph": "X") in a chrome trace written by torch.profiler."""
    with open(path) as f:
        trace = json.load(f)
    return [e["name"] for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "name" in e]


def allreduce_sizes(path: str) -> list[int]:
    """Elements per c10d::allreduce_ call in a chrome trace, in call order (torch.profiler needs record_shapes=True)."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    calls = sorted(
        (e for e in events if e.get("name") == "c10d::allreduce_" and e.get("ph") == "X"), key=lambda e: e["ts"]
    )
    sizes = []
    for e in calls:
        dims = e.get("args", {}).get("Input Dims", [[[]]])[0]  # the first input is the tensor list
        sizes.append(sum(math.prod(d) for d in dims))
    return sizes


def is_allreduce(name: str) -> bool:
    """Matches the profiler's names for an all-reduce: c10d::allreduce_, gloo:all_reduce, nccl:all_reduce."""
    return re.search(r"all_?reduce", name) is not None


# Kernel side (figures only): the per-step plot of notebook 14, redrawn while the ranks train; the throughput
# explorer.

# The line train_monitored (train.py) prints each step, as the launcher shows it: prefixed with the rank.
_STEP_LINE = re.compile(r"^\[rank (\d+)\] step (\d+) (\S+) s (\S+) MB")


_RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


def plot_steps(
    seconds: dict[int, list[float]], memory: dict[int, list[float]], samples_per_rank: int, title: str = ""
) -> Figure:
    """Two panels: global throughput per step as each rank measured it, and each rank's memory."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    world = len(seconds)
    for rank in sorted(seconds):
        rate = [world * samples_per_rank / s for s in seconds[rank]]
        left.plot(range(len(rate)), rate, marker=".", label=f"rank {rank}")
        right.plot(range(len(memory[rank])), memory[rank], marker=".", label=f"rank {rank}")
    left.set_xlabel("step"), left.set_ylabel("global samples / s")
    left.set_title("throughput (N x batch / step time)")
    right.set_ylim(bottom=0)  # from zero: a flat line should look flat, a leak like a ramp
    right.set_xlabel("step"), right.set_ylabel("MB")
    right.set_title("memory per rank")
    left.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


class LiveStepPlot:
    """Kernel side: the per-step figure, redrawn in place while the ranks train."""

    def __init__(self, nproc: int, samples_per_rank: int, live: bool | None = None, every_s: float = 0.5):
        from course_lib import viz

        self.live = (not viz.headless()) if live is None else live
        self.samples_per_rank = samples_per_rank
        self.seconds: dict[int, list[float]] = {r: [] for r in range(nproc)}
        self.memory: dict[int, list[float]] = {r: [] for r in range(nproc)}
        self.every_s = every_s
        self._last_draw = 0.0
        self._handle = None
        self.lines_seen = 0
        self._pieces: dict[str, str] = {}  # rank -> the first piece of a step line torchrun's tee split in two

    def write(self, text: str, stream: str) -> None:
        import sys

        for line in text.splitlines():
            ranked = _RANK_LINE.match(line)
            if ranked and ranked.group(1) in self._pieces:  # torchrun's tee read a line half-written
                line = f"[rank {ranked.group(1)}] {self._pieces.pop(ranked.group(1))}{ranked.group(2)}"
            match = _STEP_LINE.match(line)
            if match:
                rank = int(match.group(1))
                self.seconds.setdefault(rank, []).append(float(match.group(3)))
                self.memory.setdefault(rank, []).append(float(match.group(4)))
                self.lines_seen += 1
            elif ranked and ranked.group(2).startswith("step "):
                self._pieces[ranked.group(1)] = ranked.group(2)
            elif stream == "stderr":
                sys.stderr.write(line + "\n")  # anything else the ranks say stays visible
            else:
                sys.stdout.write(line + "\n")
        if self.live and time.monotonic() - self._last_draw > self.every_s:
            self._draw()

    def _draw(self, title: str = "live") -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        fig = plot_steps(self.seconds, self.memory, self.samples_per_rank, title)
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)
        plt.close(fig)
        self._last_draw = time.monotonic()

    def finish(self, steps: list[dict[str, list[float]]]) -> None:
        """Draw the final figure from the ranks' --out values (in place when live)."""
        import matplotlib.pyplot as plt

        seconds = {r: s["seconds"] for r, s in enumerate(steps)}
        memory = {r: s["memory_mb"] for r, s in enumerate(steps)}
        if self.live:
            self.seconds, self.memory = seconds, memory
            self._draw(title="final")
            return
        plot_steps(seconds, memory, self.samples_per_rank)
        plt.show()


def plot_stragglers(times: list[dict[str, list[float]]]) -> Figure:
    """Per-rank step times (all alike), and the median step as work plus all-reduce wait: the straggler waits least."""
    import statistics

    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3), gridspec_kw={"width_ratios": [3, 2]})
    for rank, t in enumerate(times):
        left.plot([s * 1e3 for s in t["step"]], marker=".", label=f"rank {rank}")
    left.set(xlabel="step", ylabel="ms", ylim=(0, None), title="step time per rank: the same on every rank")
    left.legend(fontsize=8)
    ranks = list(range(len(times)))
    work = [statistics.median(t["work"]) * 1e3 for t in times]
    wait = [statistics.median(t["wait"]) * 1e3 for t in times]
    right.barh(ranks, work, color="tab:blue", label="own work")
    right.barh(ranks, wait, left=work, color="tab:orange", label="waiting in all-reduce")
    right.set_yticks(ranks, [f"rank {r}" for r in ranks])
    right.invert_yaxis()
    right.set(xlabel="median ms per step", title="where each rank's step goes")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_throughput(
    window: int, skip_warmup: int, *, steps: list[dict[str, list[float]]], samples_per_step: int
) -> None:
    """Each rank's global samples per second per step, as a rolling median over `window` steps after `skip_warmup`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for r, s in enumerate(steps):
        rate = [samples_per_step / t for t in s["seconds"]][skip_warmup:]
        smooth = [statistics.median(rate[max(0, i - window + 1) : i + 1]) for i in range(len(rate))]
        ax.plot(range(skip_warmup, skip_warmup + len(rate)), smooth, label=f"rank {r}")
    ax.set_xlabel("step")
    ax.set_ylabel("global samples / s")
    ax.set_title(f"rolling median over {window} steps, first {skip_warmup} skipped")
    ax.legend(fontsize=8)
    plt.show()


def draw_hang(diagnosis: Any, program: str = "cell.py") -> None:
    """Per rank: collectives issued (flight recorder), the one others wait in that it never issued, its py-spy stack."""
    import matplotlib.pyplot as plt

    ranks = sorted(diagnosis.flight)
    last = max(diagnosis.flight[r].last_enqueued for r in ranks)
    fig, ax = plt.subplots(figsize=(2 + 1.3 * last, 0.6 + 0.5 * len(ranks)))
    for row, r in enumerate(ranks):
        issued = diagnosis.flight[r].last_enqueued
        for seq in range(1, last + 1):
            waiting = seq == issued == last and issued > min(diagnosis.flight[q].last_enqueued for q in ranks)
            color = "tab:red" if waiting else "tab:green" if seq <= issued else "white"
            ax.barh(row, 1, left=seq - 0.5, color=color, edgecolor="black")
            ax.text(seq, row, f"#{seq}" if seq <= issued else "never issued", ha="center", va="center", fontsize=8)
        inner = [f.function for f in diagnosis.stacks[r].frames if f.basename == program]
        ax.text(last + 0.7, row, f"main thread in {inner[0]}()" if inner else "", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xticks([])
    ax.set_xlim(0.4, last + 2.6)
    ax.set_title("collectives issued (flight recorder)\nred: waiting for a partner that never comes", fontsize=9)
    fig.tight_layout()
    plt.show()
