"""Notebook 06's exercise checkers: verify one checkpoint together, each rank reading its share; agree on the step.

The solutions are in notebooks/solutions/06_checkpointing.py; the expected answers are
built into each case's directories.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.checkpoint.atomic import FORMAT, METADATA, OBJECTS
from course_lib.checkpoint.integrity import latest_complete, verify
from course_lib.checkpoint.sharded import save_sharded
from course_lib.exercises import ExerciseFailed, calls_into

# ---- exercise 2: verify one checkpoint together, each rank reading only its share -------------------------------


class _Recorder:
    """What the learner's function does on this rank: files it opens under `root`, collectives, library calls."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.opened: set[str] = set()
        self.collectives = 0
        self.library: list[str] = []

    @contextmanager
    def watching(self) -> Iterator[_Recorder]:
        real_open = builtins.open

        def recording_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, os.PathLike)):
                path = Path(os.fsdecode(file)).resolve()
                if path.is_relative_to(self.root) and path.is_file():
                    self.opened.add(str(path.relative_to(self.root)))
            return real_open(file, *args, **kwargs)

        library = {"checkpoint.verify": verify, "checkpoint.latest_complete": latest_complete}
        builtins.open = io.open = recording_open  # type: ignore[assignment]  # Path.open calls io.open
        try:
            with comms.Recorder() as recorder, calls_into(library) as called:
                yield self
        finally:
            builtins.open = io.open = real_open
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
    """(what, directory, complete?, {file: bytes}) per case; the same on every rank (built from the same seed).

    The checkpoints were saved by more ranks than verify them (world_size + 1 or + 2 shard files), and the damaged
    file is drawn: a rank that checks only shard_<its rank>.bin, or only sizes, misses it.
    """
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
    """Exercise checker: every rank calls verify_together(directory) on the same checkpoint, for secret checkpoints
    (complete, or with one damaged file drawn at every call) of more shard files than there are ranks.

    Recorded on each rank during the call: the files it opens, the collectives it calls, and any call into
    checkpoint.verify or latest_complete (refused: they read every file on every rank that calls them). Every rank
    must return the same bool, the right one; together the ranks must open every file the metadata lists, and no
    rank much more than its share: max(ceil(F/N) files, S_files/N + one file) bytes.
    """
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


def _resume_views(base: Path, rank: int, world_size: int) -> list[tuple[str, Path, int | None]]:
    """Per case: this rank's view of the checkpoint directory, and the step rank 0's view resumes from.

    Each node sees the shared directory with a lag, or has its own disk: rank 0's newest complete
    checkpoint (a random step, drawn on rank 0) is missing, uncommitted or truncated in the other ranks' views.
    """

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(4.0) + step, "step": step}, no_dist=True)

    drawn = [random.Random().randrange(6, 60, 2) if rank == 0 else None]
    dist.broadcast_object_list(drawn)  # the checker's own collective, before the learner's function runs
    newest = int(drawn[0])  # type: ignore[arg-type]
    cases: list[tuple[str, Path, int | None]] = []
    root = base / "lagging"
    save(root, 4)
    if rank == 0:
        save(root, newest)
    else:
        save(root, newest).rename(root / f"step_{newest}.tmp")  # not yet committed in this view
    cases.append((f"rank 0 sees step_{newest} committed, the others do not yet", root, newest))
    root = base / "rank0_truncated"
    for step in (2, newest):
        save(root, step)
    if rank == 0:
        shard = root / f"step_{newest}" / "shard_0.bin"
        shard.write_bytes(shard.read_bytes()[:-8])
    cases.append((f"rank 0's step_{newest} is truncated, the others' is fine", root, 2))
    root = base / "only_others"
    if rank != 0:
        save(root, newest)
    cases.append(("rank 0 sees no checkpoint, the others do", root, None))
    return cases


def check_agreed_resume_step(resume_step: Callable[[str], Any]) -> None:
    """Exercise checker: every rank must return the step rank 0's newest complete checkpoint has (or None).

    Each rank gets its own view of the directory (see _resume_views), so a rank that decides alone
    resumes from another step than rank 0. After each case the ranks agree on whether anyone was wrong,
    so they stop together.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _resume_views(Path(base), rank, world_size):
            wrong = None
            try:
                got = resume_step(str(root))
                if got != expected:
                    wrong = f"case '{what}': returned step {got!r}, rank 0 resumes from step {expected!r}"
            except Exception as error:
                wrong = f"case '{what}': your function raised {type(error).__name__}: {error}"
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, wrong is not None)
            if wrong:
                raise ExerciseFailed(wrong)
            if any(everyone):
                return  # another rank's answer was wrong; that rank reports it
