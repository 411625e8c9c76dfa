"""Rank programs of tests/test_fault_tolerance.py: the solutions as the ranks find them; the resume exercise's
answers, right and wrong, against its checker."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

from course_lib import checkpoint as ck
from course_lib import fault_tolerance as ft

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "07_fault_tolerance.py"


def solutions() -> dict:
    """notebooks/solutions/07_fault_tolerance.py, with the notebook's names its prediction reads."""
    from course_lib.models import MLP

    return runpy.run_path(str(SOLUTIONS), init_globals={"parameters": sum(p.numel() for p in MLP().parameters())})


def diloco_outer_step(model: Any, anchor: Any, outer_optimizer: Any) -> None:
    """The solution of exercise 2, as the ranks find it (the solutions file needs the notebook's names to run)."""
    solutions()["diloco_outer_step"](model, anchor, outer_optimizer)


# Answers to the resume exercise that the checker must reject, each for its own reason.


def resume_alone(root: str) -> int | None:
    """The broken program of the exercise: each rank decides from its own view."""
    found, _ = ck.latest_complete(root)
    return None if found is None else int(found.name.removeprefix("step_"))


def resume_newest_anyone_has(root: str) -> int | None:
    """Communicates, but takes the newest step any rank sees: a step rank 0 cannot load."""
    import torch.distributed as dist

    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, resume_alone(root))
    steps = [v for v in views if v is not None]
    return max(steps) if steps else None


def resume_oldest_everyone_has(root: str) -> int | None:
    """Communicates, but takes the oldest: the ranks agree, on a step older than rank 0's good one."""
    import torch.distributed as dist

    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, resume_alone(root))
    return None if None in views else min(views)


def resume_verdicts(rank: int, world_size: int) -> dict:
    """The resume checker against the solution and the wrong answers: 'passed' or the message, per candidate."""
    candidates = [solutions()["resume_step"], resume_alone]
    candidates += [resume_newest_anyone_has, resume_oldest_everyone_has]
    verdicts = {}
    for candidate in candidates:
        try:
            ft.check_agreed_resume_step(candidate)
            verdicts[candidate.__name__] = "passed"
        except ck.CheckpointError as error:
            verdicts[candidate.__name__] = f"raised {error}"
        except AssertionError as failure:  # ExerciseFailed
            verdicts[candidate.__name__] = str(failure)
    return verdicts
