"""Notebook 06's checkers: verify a checkpoint together, each rank reading its share; resume the newest complete one."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from course_lib import comms
from course_lib.checkpoint.atomic import FORMAT, METADATA, OBJECTS, latest_complete, verify
from course_lib.exercises import ExerciseFailed, calls_into

# ---- exercise 2: verify one checkpoint together, each rank reading only its share -------------------------------


_WATCHING: list[_Recorder] = []  # the recorder the audit hook reports to (a hook cannot be removed: one per process)
_WATCHING_INSTALLED: list[bool] = []


def _report_open(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _WATCHING:
        _WATCHING[-1].saw_open(args[0])


class _Recorder:
    """What the learner's function does on this rank: files it opens under `root`, collectives, library calls."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.opened: set[str] = set()
        self.collectives = 0
        self.library: list[str] = []

    def saw_open(self, file: Any) -> None:
        if isinstance(file, (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(file)).resolve()
            if path.is_relative_to(self.root) and path.is_file():
                self.opened.add(str(path.relative_to(self.root)))

    @contextmanager
    def watching(self) -> Iterator[_Recorder]:
        library = {"checkpoint.verify": verify, "checkpoint.latest_complete": latest_complete}
        if not _WATCHING_INSTALLED:
            # the "open" audit event: open(), io.open, Path.open, os.open and numpy.fromfile all raise it
            sys.addaudithook(_report_open)
            _WATCHING_INSTALLED.append(True)
        _WATCHING.append(self)
        try:
            with comms.Recorder() as recorder, calls_into(library) as called:
                yield self
        finally:
            _WATCHING.pop()
        self.collectives = len(comms.outermost(recorder.calls))
        self.library = called


def _write_checkpoint(directory: Path, draw: random.Random, n_shards: int) -> dict[str, int]:
    """A checkpoint in our format, of secret random bytes: shard files of ~50 kB, objects.pt, metadata.json."""
    directory.mkdir(parents=True)
    files = {f"shard_{r}.bin": draw.randrange(48_000, 52_000) for r in range(n_shards)}
    files[OBJECTS] = draw.randrange(1_000, 2_000)
    listed = {}
    for name, size in files.items():
        data = draw.randbytes(size)
        (directory / name).write_bytes(data)
        listed[name] = {"bytes": size, "sha256": hashlib.sha256(data).hexdigest()}
    (directory / METADATA).write_text(json.dumps({"format": FORMAT, "files": listed, "tensors": {}}))
    return files


def _verify_cases(base: Path, seed: int, world_size: int) -> list[tuple[str, Path, bool, dict[str, int]]]:
    """(what, directory, complete?, {file: bytes}) per case; the same on every rank (built from the same seed)."""
    draw = random.Random(seed)
    n_shards = world_size + 1 + draw.randrange(2)
    steps = iter(draw.sample(range(10, 1000), 8))
    cases: list[tuple[str, Path, bool, dict[str, int]]] = []

    def case(what: str, complete: bool, damage: Callable[[Path, dict[str, int]], str], suffix: str = "") -> None:
        directory = base / f"step_{next(steps)}{suffix}"
        files = _write_checkpoint(directory, draw, n_shards)
        cases.append((what.format(damage(directory, files)), directory, complete, files))

    def flip(directory: Path, name: str) -> str:
        data = bytearray((directory / name).read_bytes())
        data[draw.randrange(len(data))] ^= 0xFF
        (directory / name).write_bytes(bytes(data))
        return name

    def truncate(directory: Path, name: str) -> str:
        (directory / name).write_bytes((directory / name).read_bytes()[:-100])
        return name

    def remove(directory: Path, name: str) -> str:
        (directory / name).unlink()
        return name

    far = f"shard_{draw.randrange(world_size, n_shards)}.bin"  # beyond every verifying rank's own number
    anyone = f"shard_{draw.randrange(n_shards)}.bin"
    gone = f"shard_{draw.randrange(n_shards)}.bin"
    case("a complete checkpoint{}", True, lambda d, f: "")
    case("{} has one byte changed (same size)", False, lambda d, f: flip(d, far))
    case("{} is truncated", False, lambda d, f: truncate(d, anyone))
    case("{} has one byte changed (same size)", False, lambda d, f: flip(d, OBJECTS))
    case("{} is missing: the save died before its last line", False, lambda d, f: remove(d, METADATA))
    case("{} is missing", False, lambda d, f: remove(d, gone))
    case("{}: an uncommitted save (complete files, but the rename never happened)", False, lambda d, f: d.name, ".tmp")
    case("another complete checkpoint{}", True, lambda d, f: "")
    return cases


def check_verify_together(verify_together: Callable[[str], Any]) -> None:
    """Checker: all ranks verify secret checkpoints (more shard files than ranks), complete or with one file damaged."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    secret: list[Any] = [random.Random().randrange(2**63) if rank == 0 else None]
    dist.broadcast_object_list(secret)
    with tempfile.TemporaryDirectory() as base:
        for what, directory, complete, files in _verify_cases(Path(base), int(secret[0]), world_size):
            recorder = _Recorder(directory)
            with recorder.watching():
                got = verify_together(str(directory))
            seen: list[Any] = [None] * world_size
            report = (got if isinstance(got, bool) else type(got).__name__, sorted(recorder.opened))
            dist.all_gather_object(seen, (*report, recorder.collectives, recorder.library))
            problem = _judge_verify(what, directory.name, complete, files, seen, world_size)
            if problem is not None:
                if rank == problem[0]:
                    raise ExerciseFailed(problem[1])
                return


def _judge_verify(
    what: str, name: str, complete: bool, files: dict[str, int], seen: list[Any], world_size: int
) -> tuple[int, str] | None:
    """(the rank that reports, its message) for the first problem in every rank's record, or None."""
    case = f"case '{what}' ({name})"
    for r, (_, _, _, library) in enumerate(seen):
        if library:
            return r, (
                f"{case}: your function calls {library[0]} (recorded), which opens and hashes every file of the "
                "checkpoint on each rank that calls it. Split the files over the ranks: each checks its share"
            )
    for r, (got, *_) in enumerate(seen):
        if not isinstance(got, bool):
            return r, f"{case}: return True or False (a Python bool) on every rank, got {got}"
    opened = [set(o) & set(files) for _, o, _, _ in seen]
    if complete and not set().union(*opened):
        return 0, (
            f"{case}: no rank opened any of the {len(files)} files the metadata lists: a file can keep its size and "
            "still be corrupt. Hash the files' bytes"
        )
    unread = sorted(set(files) - set().union(*opened))
    if complete and unread:
        return 0, f"{case}: no rank opened {', '.join(unread)}: damage there would go unnoticed"
    total, largest = sum(files.values()), max(files.values())
    budget = max(-(-len(files) // world_size) * largest, total // world_size + largest)
    for r, mine in enumerate(opened):
        read = sum(files[f] for f in mine)
        if read > budget:
            return r, (
                f"{case}: rank {r} opened {len(mine)} of the {len(files)} files ({read:,} of {total:,} B): each rank "
                f"should check only its share, about {total // world_size:,} B on {world_size} ranks"
            )
    answers = [got for got, *_ in seen]
    if len(set(answers)) > 1:
        r = next(i for i, got in enumerate(answers) if got != complete)
        other = next(i for i, got in enumerate(answers) if got == complete)
        alone = " (it made no collective call)" if seen[r][2] == 0 else ""
        return r, (
            f"{case}: rank {r} returned {answers[r]}{alone}, rank {other} returned {answers[other]}: each rank saw "
            "only its own files. The ranks must combine their verdicts and all return the same answer"
        )
    if answers[0] != complete:
        verdict = "complete" if complete else "not complete"
        return 0, f"{case}: every rank returned {answers[0]}, but the checkpoint is {verdict}"
    return None


def _resume_cases(base: Path, draw: random.Random) -> list[tuple[str, Path, int | None]]:
    """(what, directory, step to resume from) cases where the newest checkpoint by name is never the answer."""
    steps = sorted(draw.sample(range(5, 10), 2)) + sorted(draw.sample(range(10, 50), 2))  # 5-9 sort after 10-49
    cases: list[tuple[str, Path, int | None]] = []
    root = base / "by_number"
    for step in steps:
        _write_checkpoint(root / f"step_{step}", draw, 2)
    cases.append((f"steps {steps}: step_{steps[1]} sorts last by name", root, steps[-1]))
    root = base / "uncommitted"
    for step in steps[:3]:
        _write_checkpoint(root / f"step_{step}", draw, 2)
    _write_checkpoint(root / f"step_{steps[3]}.tmp", draw, 2)
    cases.append((f"step_{steps[3]}.tmp never renamed", root, steps[2]))
    root = base / "truncated"
    for step in steps:
        _write_checkpoint(root / f"step_{step}", draw, 2)
    shard = root / f"step_{steps[3]}" / "shard_1.bin"
    shard.write_bytes(shard.read_bytes()[:-64])
    cases.append((f"step_{steps[3]}/shard_1.bin truncated", root, steps[2]))
    root = base / "nothing_complete"
    _write_checkpoint(root / f"step_{steps[0]}.tmp", draw, 2)
    cases.append(("only an uncommitted save", root, None))
    return cases


def check_newest_complete_step(newest_complete_step: Callable[[str], Any]) -> None:
    """Checker on secret roots where name order, a .tmp or a truncated checkpoint mislead; latest_complete refused."""
    seed = random.Random().randrange(2**63)
    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _resume_cases(Path(base), random.Random(seed)):
            with calls_into({"checkpoint.latest_complete": latest_complete}) as called:
                got = newest_complete_step(str(root))
            if called:
                raise ExerciseFailed(
                    "your function calls checkpoint.latest_complete, the library's answer to this exercise: choose "
                    "the step yourself (checkpoint.verify may check each candidate)"
                )
            if got != expected:
                raise ExerciseFailed(f"case '{what}': returned {got!r}, the newest complete checkpoint is {expected!r}")
