"""Every rank's Python stack, read from outside the process: ``py-spy dump``, parsed into frames."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # as py-spy prints it: shortened for installed packages
    line: int
    variables: tuple[tuple[str, str], ...] = ()  # arguments and locals, as py-spy renders them

    @property
    def basename(self) -> str:
        return Path(self.file).name


@dataclass(frozen=True)
class ThreadStack:
    name: str
    idle: bool  # py-spy's view of the OS thread: sleeping (waiting on a lock, a socket, a sleep), not running
    frames: tuple[Frame, ...]  # innermost first, as py-spy prints them

    def shape(self) -> tuple[tuple[str, int, tuple[tuple[str, str], ...]], ...]:
        """What two dumps of a stuck thread have in common: every frame's function, line and variables."""
        return tuple((f.function, f.line, f.variables) for f in self.frames)


def py_spy_executable() -> str:
    """py-spy next to this Python (the course's .venv/bin), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise FileNotFoundError("py-spy is not installed: `pip install py-spy` (it is in the course's dependencies)")
    return found


def dump_stack(pid: int, timeout_s: float = 30.0) -> str:
    """The text of ``py-spy dump --locals --pid PID``: every Python thread's stack, with its variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("CLICOLOR_FORCE", "FORCE_COLOR")}
    done = subprocess.run(
        [py_spy_executable(), "dump", "--locals", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**env, "NO_COLOR": "1", "CLICOLOR": "0"},  # a notebook kernel asks for colours: plain text here
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()
        raise RuntimeError(f"py-spy dump --pid {pid} failed (exit {done.returncode}): {why}")
    return done.stdout


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_THREAD = re.compile(r'^Thread \S+ \(([\w+]+)\): "(.*)"$')
_FRAME = re.compile(r"^ {4}(\S.*?) \((.+):(\d+)\)$")
_VARIABLE = re.compile(r"^ {12}([A-Za-z_]\w*): (.*)$")


def parse_dump(text: str) -> list[ThreadStack]:
    """The threads of one py-spy dump, each with its frames (innermost first) and their variables."""
    threads: list[ThreadStack] = []
    name, idle = "", False
    frames: list[Frame] | None = None  # the current thread's, None before the first thread
    for line in _ANSI.sub("", text).splitlines():
        if m := _THREAD.match(line):
            if frames is not None:
                threads.append(ThreadStack(name, idle, tuple(frames)))
            name, idle, frames = m.group(2), m.group(1) == "idle", []
        elif frames is not None and (m := _FRAME.match(line)):
            frames.append(Frame(m.group(1), m.group(2), int(m.group(3))))
        elif frames and (m := _VARIABLE.match(line)):
            last = frames[-1]
            frames[-1] = replace(last, variables=(*last.variables, (m.group(1), m.group(2))))
    if frames is not None:
        threads.append(ThreadStack(name, idle, tuple(frames)))
    return threads


def main_thread(text: str) -> ThreadStack:
    """The MainThread of a py-spy dump (where a rank runs its training loop)."""
    for thread in parse_dump(text):
        if thread.name == "MainThread":
            return thread
    raise ValueError(f"no MainThread in this py-spy dump:\n{text}")


def describe(stack: ThreadStack, program: str = "cell.py", variables: tuple[str, ...] = ()) -> str:
    """One line: the innermost frame, then every frame of `program` with its line and the named variables."""
    parts = []
    for i, frame in enumerate(stack.frames):
        if frame.basename == program:
            numbers = [f"{k}={v}" for k, v in frame.variables if k in variables]
            parts.append(f"{frame.function} (cell line {', '.join([str(frame.line), *numbers])})")
        elif i == 0:
            parts.append(f"{frame.function} ({frame.basename})")
    return " <- ".join(parts)
