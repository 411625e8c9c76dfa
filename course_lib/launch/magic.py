"""The `%%torchrun` cell magic: the cell body runs on N ranks under torchrun.

The flags are defined here once, with their help, and go as text to RunSpec.create, the one place that checks them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from course_lib.launch.launcher import run_cell, standalone_script
from course_lib.launch.spec import LaunchError, RunSpec, describe_backend

_RDZV_HELP = "torchrun's own flag, passed through (several nodes: see launch/README.md)"


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments(name="%torchrun")  # the usage line then reads %%torchrun
    @argument(
        "-n",
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        metavar="N",
        help=f"ranks on this node (default {RunSpec.nproc})",
    )
    @argument(
        "--backend",
        metavar="NAME",
        help=f"auto (nccl with one GPU per rank where GPUs exist, else gloo), gloo or nccl (default {RunSpec.backend})",
    )
    @argument(
        "--timeout",
        metavar="S",
        help="wall-clock seconds for the whole run, start-up included, before every process is ended "
        f"(default {RunSpec.timeout:g})",
    )
    @argument(
        "--out",
        metavar="NAMES",
        help="comma-separated names whose values come back into the notebook, as lists indexed by rank",
    )
    @argument(
        "--push", metavar="NAMES", help="comma-separated notebook variables sent to every rank before the cell runs"
    )
    @argument("--stream", action="store_const", const=True, help="print rank output live, prefixed [rank N]")
    @argument(
        "--no-init",
        dest="init",
        action="store_const",
        const=False,
        help="do not create the process group: the cell calls init_process_group itself. It still gets "
        "rank, world_size and local_rank (from torchrun's environment) and torch; no dist, no device",
    )
    @argument("--save", metavar="PATH", help="also write the cell as a script for plain torchrun")
    @argument(
        "--max-restarts",
        metavar="K",
        help=f"torchrun restarts of the whole group after a failure (default {RunSpec.max_restarts})",
    )
    @argument("--nnodes", metavar="N", help=_RDZV_HELP)
    @argument("--node-rank", metavar="I", help=_RDZV_HELP)
    @argument("--rdzv-endpoint", metavar="HOST:PORT", help=_RDZV_HELP)
    @argument("--rdzv-backend", metavar="NAME", help=_RDZV_HELP)
    @argument("--rdzv-id", metavar="ID", help=_RDZV_HELP)
    @cell_magic
    def torchrun(self, line: str, cell: str) -> None:
        """Run the cell on N fresh ranks under torchrun, with torch, dist, rank, world_size, local_rank and device."""
        shell = self.shell
        assert shell is not None, "the magic is registered by load_ext, which sets the shell"
        flags = parse_flags(line)
        save = flags.pop("save", None)
        spec = RunSpec.create(**flags)
        undefined = [n for n in spec.push if n not in shell.user_ns]
        if undefined:
            raise LaunchError(
                f"--push names {', '.join(undefined)}, not defined in the notebook: run the cell that defines it first"
            )
        if save:
            # The backend as asked: "auto" in a saved script picks on the machine that runs it.
            backend = flags.get("backend", RunSpec.backend)
            Path(save).write_text(standalone_script(cell, backend=backend, init=spec.init, nproc=spec.nproc))
        print(describe_backend(spec.backend, spec.nproc, spec.init), end="")  # on a GPU node: what 'auto' picked
        result = run_cell(spec, cell, {n: shell.user_ns[n] for n in spec.push})
        shell.user_ns.update(result.values)
        shell.user_ns["_torchrun"] = result


# magic_arguments' parser cannot be built with allow_abbrev=False; argparse reads it when parsing.
# Without it `--time 5` would pass for --timeout.
TorchrunMagics.torchrun.parser.allow_abbrev = False  # type: ignore[attr-defined]


def parse_flags(line: str) -> dict[str, Any]:
    """The flags given in `line`, as text, by RunSpec field name (and `save`); LaunchError for a bad line."""
    try:
        args = parse_argstring(TorchrunMagics.torchrun, line)
    except (UsageError, ValueError) as error:  # ValueError: unbalanced quotes
        raise LaunchError(f"%%torchrun: {error} (`%%torchrun?` lists every flag)") from None
    return {name: value for name, value in vars(args).items() if value is not None}
