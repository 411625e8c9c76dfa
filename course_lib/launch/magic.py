"""The `%%torchrun` cell magic: the cell body runs on N ranks under torchrun.

    %%torchrun -n $NPROC --backend $BACKEND --out loss
    loss = train_one_step(rank)

See `%%torchrun?` for every flag. The work is done by course_lib.launch.launcher.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from IPython.core.magic import Magics, cell_magic, magics_class

from course_lib.launch import launcher


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit the kernel's SystemExit path
        raise launcher.LaunchError(f"{message}. Usage: {self.format_usage().strip()}")


def _parser() -> _Parser:
    p = _Parser(prog="%%torchrun", add_help=False, allow_abbrev=False)
    p.add_argument(
        "-n", "--nproc-per-node", "--nproc", dest="nproc", default="2", help="ranks on this node (default 2)"
    )
    p.add_argument("--backend", default="auto", help="auto (nccl with GPUs, else gloo), gloo or nccl")
    p.add_argument(
        "--timeout",
        default=str(launcher.DEFAULT_TIMEOUT_S),
        help=f"wall-clock seconds for the whole run, start-up included, before every process is ended "
        f"(default {launcher.DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--out", default="", help="comma-separated names whose per-rank values come back as lists")
    p.add_argument("--push", default="", help="comma-separated notebook variables sent to every rank")
    p.add_argument("--stream", action="store_true", help="print rank output live, prefixed [rank N]")
    p.add_argument(
        "--no-init",
        dest="init",
        action="store_false",
        help="do not create the process group: the cell calls init_process_group itself",
    )
    p.add_argument("--save", default=None, help="also write the cell as a script for plain torchrun")
    p.add_argument("--max-restarts", default="0", help="torchrun restarts of the whole group after a failure")
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id"):
        p.add_argument(flag, default=None, help="passed to torchrun")
    return p


def _as_int(value: str, flag: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise launcher.LaunchError(f"{flag} takes a whole number, got {value!r}") from None


def _as_float(value: str, flag: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise launcher.LaunchError(f"{flag} takes a number of seconds, got {value!r}") from None


@magics_class
class TorchrunMagics(Magics):
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run the cell on N ranks under torchrun. Flags: -n N, --backend auto|gloo|nccl,
        --timeout S, --out a,b, --push a,b, --stream, --no-init, --save PATH,
        --max-restarts K, and torchrun's --nnodes/--node-rank/--rdzv-endpoint/--rdzv-backend/--rdzv-id.

        With the default init, the body sees `torch`, `dist`, `rank`, `world_size`,
        `local_rank` and `device`, and the process group is destroyed after it.
        """
        shell = self.shell
        assert shell is not None, "the magic is registered by load_ext, which sets the shell"
        args = _parser().parse_args(shlex.split(line))
        nproc = launcher.check_nproc(args.nproc)
        out = launcher.check_names(args.out.split(","), "--out")
        push_names = launcher.check_names(args.push.split(","), "--push")
        undefined = [n for n in push_names if n not in shell.user_ns]
        if undefined:
            raise launcher.LaunchError(
                f"--push names {', '.join(undefined)}, not defined in the notebook: run the cell that defines it first"
            )
        push = {n: shell.user_ns[n] for n in push_names}
        if args.save:
            launcher.resolve_backend(args.backend, nproc)  # refuse impossible requests before writing
            Path(args.save).write_text(
                launcher.standalone_script(cell, backend=args.backend, init=args.init, nproc=nproc)
            )
        result = launcher.launch(
            cell,
            nproc,
            backend=args.backend,
            timeout=_as_float(args.timeout, "--timeout"),
            out=out,
            push=push,
            stream=args.stream,
            init=args.init,
            max_restarts=_as_int(args.max_restarts, "--max-restarts"),
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_backend=args.rdzv_backend,
            rdzv_id=args.rdzv_id,
        )
        shell.user_ns.update(result.values)
        shell.user_ns["_torchrun"] = result
