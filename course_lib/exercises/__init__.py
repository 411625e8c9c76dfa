"""Learner functions run on N real ranks and judged there; a stub is not run, and checkers are named by module."""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any


class ExerciseFailed(AssertionError):
    """Raised on a rank by a checker: the message says what is wrong there."""


def expect_equal(what: str, got: Any, expected: Any, *, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Compare tensors, numbers or sequences; name the first wrong element."""
    import torch

    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"{what}: expected a tensor, got {type(got).__name__}")
        expected = torch.as_tensor(expected)
        if got.shape != expected.shape:
            raise ExerciseFailed(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
        wrong = ~torch.isclose(got.double(), expected.double(), rtol=rtol, atol=atol)
        if wrong.any():
            index = tuple(int(i) for i in wrong.nonzero()[0])
            raise ExerciseFailed(
                f"{what}: element {list(index)} expected {expected[index].item():g}, "
                f"got {got[index].item():g} ({int(wrong.sum())} of {wrong.numel()} elements wrong)"
            )
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            raise ExerciseFailed(f"{what}: expected {expected!r}, got {got!r}")
        for i, (g, e) in enumerate(zip(got, expected)):
            expect_equal(f"{what}[{i}]", g, e, atol=atol, rtol=rtol)
        return
    if isinstance(expected, float):
        ok = isinstance(got, (int, float)) and abs(got - expected) <= atol + rtol * abs(expected)
    else:
        ok = got == expected
    if not ok:
        raise ExerciseFailed(f"{what}: expected {expected!r}, got {got!r}")


@contextlib.contextmanager
def calls_into(functions: dict[str, Callable | type]) -> Iterator[list[str]]:
    """Names of `functions` that ran in the block, in order, matched by code so aliased or pre-bound calls count too."""
    codes = {code: name for name, function in functions.items() for code in _codes(function)}
    ran: list[str] = []
    previous = sys.getprofile()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            ran.append(codes[frame.f_code])

    sys.setprofile(profile)
    try:
        yield ran
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def refusing(*functions: Callable | type, why: str) -> Iterator[None]:
    """Fail the exercise with `why` if the course's own solution (`functions`, or their methods) ran in the block."""
    with calls_into({getattr(f, "__qualname__", repr(f)): f for f in functions}) as ran:
        try:
            yield
        finally:
            if ran:
                raise ExerciseFailed(why)


def _codes(function: Callable | type) -> list[Any]:
    if isinstance(function, type):
        members = [getattr(m, "__func__", getattr(m, "fget", m)) for m in vars(function).values()]
        return [m.__code__ for m in members if hasattr(m, "__code__")]
    return [function.__code__]


def is_stub(fn: Callable) -> bool:
    """True while the body is only a docstring, `pass`, `...` or `raise NotImplementedError`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    definition = tree.body[0]
    assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)), "is_stub takes a function"
    body = definition.body
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstring or ...
        if isinstance(node, ast.Pass):
            continue
        if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node):
            continue
        return False
    return True


def check(
    fn: Callable,
    checker: Callable[[Callable], None],
    *,
    nproc: int = 2,
    backend: str = "auto",
    timeout: float = 120,
    quiet: bool = False,
) -> bool | None:
    """Judge `fn` by `checker` on max(nproc, 2) ranks: True, False or None (not attempted); never raises if wrong."""
    from course_lib import launch

    say = (lambda *a: None) if quiet else print
    name = fn.__name__
    # On one rank every collective is the identity, so any answer would pass: a checker runs on at least two.
    if nproc < 2:
        from course_lib.launch.spec import backend_for

        nproc, backend = 2, backend_for(2, backend)
    if is_stub(fn):
        say(f"{name}: not attempted yet")
        return None
    module, func = _importable(checker)
    body = textwrap.dedent(inspect.getsource(fn)) + f"\nfrom {module} import {func} as _check\n_check({name})\n"
    try:
        launch.launch(body, nproc, backend=backend, timeout=timeout, write=lambda text, stream: None)
    except launch.RankFailedError as error:
        if not error.failures:
            say(f"✗ {name}: {error}")
            return False
        first = error.failures[0]
        if first.kind == "raised" and first.summary.startswith("ExerciseFailed: "):
            say(f"✗ {name}: rank {first.rank}: {first.summary.removeprefix('ExerciseFailed: ')}")
        elif first.kind == "raised":
            say(f"✗ {name}: on rank {first.rank} your function raised {first.summary}")
        else:
            say(f"✗ {name}: rank {first.rank} {first.summary}")
        return False
    say(f"✓ {name}: correct on {nproc} ranks")
    return True


def _importable(checker: Callable) -> tuple[str, str]:
    """(module, name) under which a rank imports `checker`: it must be a module-level function."""
    import sys

    module, name = getattr(checker, "__module__", None), getattr(checker, "__qualname__", "")
    if module is None or getattr(sys.modules.get(module), name, None) is not checker:
        raise TypeError(f"the checker must be a module-level function of course_lib, got {checker!r}")
    return module, name


def check_prediction(
    name: str, predicted: float | None, actual: float, *, rtol: float = 0.05, unit: str = ""
) -> bool | None:
    """A "predict before you run" verdict within `rtol`; `actual` goes in hidden metadata so tests can prove no leak."""
    if predicted is None:
        verdict, result = f"{name}: not attempted yet", None
    elif not isinstance(predicted, (int, float)) or isinstance(predicted, bool):
        verdict, result = f"✗ {name}: give a number, got {type(predicted).__name__}", False
    else:
        error = (predicted - actual) / abs(actual) if actual else float(predicted)
        if abs(error) <= rtol:
            verdict, result = f"✓ {name}: {predicted:g}{unit} is right (measured {actual:g}{unit})", True
        else:
            direction = "high" if error > 0 else "low"
            verdict = (
                f"✗ {name}: {predicted:g}{unit} is {abs(error):.0%} too {direction}; check the formula and try again"
            )
            result = False
    _show(verdict, metadata={PREDICTION_METADATA: {"name": name, "measured": float(actual), "unit": unit.strip()}})
    return result


PREDICTION_METADATA = "course_lib.prediction"


def _show(text: str, metadata: dict) -> None:
    """`text` as a plain-text display carrying `metadata` in a kernel; printed elsewhere."""
    from IPython import get_ipython

    if get_ipython() is None:
        print(text)
        return
    from IPython.display import publish_display_data

    publish_display_data({"text/plain": text}, metadata=metadata)
