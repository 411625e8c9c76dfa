"""course_lib: the library behind the distributed-training notebooks.

`%load_ext course_lib` registers the `%%torchrun` cell magic. Importing the
package stays cheap (no torch, no IPython): every rank imports it at start-up.
"""

from typing import Any

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:  # an InteractiveShell
    from course_lib.launch.magic import TorchrunMagics

    ipython.register_magics(TorchrunMagics)
