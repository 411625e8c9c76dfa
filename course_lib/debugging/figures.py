"""Kernel side (figures only): the per-step plot of notebook 12, redrawn while the ranks train; the throughput
explorer."""

from __future__ import annotations

import re
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
    """Kernel side: the per-step figure, redrawn in place while the ranks train.

    Pass ``write=live.write`` and ``stream=True`` to launcher.launch: it reads the ranks'
    ``step ...`` lines as they come. In JupyterLab the figure updates through a display handle;
    headless (COURSE_HEADLESS=1, papermill, nbval) nothing is drawn until :meth:`finish`, which
    draws the final figure from the values the ranks returned.
    """

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
    """Left: every rank's step time, step by step (all alike). Right: each rank's median step split
    into its own work and its wait in the all-reduce (the straggler works longest and waits least)."""
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
    """Each rank's global samples per second, step by step (`samples_per_step` / its step's seconds), as a rolling
    median over `window` steps after the first `skip_warmup`."""
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
