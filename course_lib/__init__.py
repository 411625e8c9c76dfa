"""course_lib: the notebooks' library (`%load_ext course_lib`); importing it stays cheap (no torch): every rank does."""

from typing import Any

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:  # an InteractiveShell
    from course_lib.launch.magic import TorchrunMagics
    from course_lib.launch.processes import start_forkserver
    from course_lib.session.magic import DistMagics, NoSessionMagics

    start_forkserver()  # it imports torch while the learner reads: the first cell starts as fast as the next

    ipython.register_magics(TorchrunMagics)
    ipython.register_magics(DistMagics)
    if "SessionParallelMagics" not in ipython.magics_manager.registry:  # a second %load_ext keeps a running session
        ipython.register_magics(NoSessionMagics)
