"""Before class: can this machine (a GPU node or a laptop) run the course? One run, under a minute.

    launch/check_node.sh                 # the same as: python -m tools.preflight
    launch/check_node.sh --no-plan       # without each notebook's NPROC (the probe's kernels)

It reports the GPUs, driver, torch, CUDA and NCCL; each notebook's NPROC and backend as `make course` and
`launch/gpu_node.sh` will choose them (the runner's own rules: runner.notebook_defaults, runner.planned_backend
and probe.choose_nproc); the TF32 override variables; where the kernels' sockets go (zmq's 107 characters);
the compilers torch.compile needs; float8's tensor cores; and a 2-rank all-reduce's bus bandwidth, measured
with the course's launcher and collectives.lab.benchmark, beside what the link between two GPUs should give.
Each finding is ok, a note (worth knowing), or a PROBLEM (the course would break): each PROBLEM and note says
what to do. The exit status is 1 when there is a PROBLEM.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools import probe, runner
from tools.node import Node, all_reduce_busbw, gather, link_bandwidth

OK, NOTE, PROBLEM = "ok", "note", "PROBLEM"
TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"  # NGC containers set it; with fp32_precision="ieee" it raises
# The oldest driver each CUDA major version of torch's build runs on (NVIDIA's minor-version compatibility).
MIN_DRIVER = {12: (525, 60), 13: (580, 0)}


@dataclass
class Finding:
    status: str  # OK, NOTE or PROBLEM
    topic: str
    text: str
    fix: str = ""


def pinned_torch() -> str:
    """The torch version pyproject.toml pins."""
    found = re.search(r'"torch==([^"]+)"', (runner.ROOT / "pyproject.toml").read_text())
    return found.group(1) if found else "?"


def check_software(node: Node) -> list[Finding]:
    pin, have = pinned_torch(), node.torch_version.split("+")[0]
    versions = f"torch {node.torch_version}, CUDA {node.cuda or '- (a CPU build)'}, NCCL {node.nccl or '-'}"
    if have != pin:
        found = [
            Finding(
                PROBLEM,
                "torch",
                f"{versions}; the course pins torch {pin}: cells that use its names fail",
                "install the pinned torch: make .venv/.installed (REFRESH_VENV=1 launch/gpu_node.sh)",
            )
        ]
    else:
        found = [Finding(OK, "torch", f"{versions}, as pyproject.toml pins")]
    if node.smi_gpus and not node.gpus:
        found.append(
            Finding(
                PROBLEM,
                "GPUs",
                f"nvidia-smi lists {node.smi_gpus} GPUs, torch sees none ({versions})",
                "install torch's CUDA build into .venv, or a driver as new as its CUDA needs",
            )
        )
    if node.gpus and node.cuda and node.driver:
        need = MIN_DRIVER.get(int(node.cuda.split(".")[0]))
        have_driver = tuple(int(p) for p in node.driver.split(".")[:2])
        if need and have_driver < need:
            found.append(
                Finding(
                    PROBLEM,
                    "driver",
                    f"{node.driver} is older than CUDA {node.cuda} needs ({'.'.join(map(str, need))})",
                    "update the driver, or use torch of an older CUDA",
                )
            )
        else:
            found.append(
                Finding(OK, "driver", f"{node.driver} (CUDA {node.cuda} needs {'.'.join(map(str, need or ()))}+)")
            )
    return found


def check_gpus(node: Node) -> list[Finding]:
    if not node.gpus:
        return [
            Finding(OK, "GPUs", "none: the CPU course, `make course` (every cell on CPU processes over gloo)"),
            Finding(OK, "float8", "no GPU: notebook 04's float8 runs emulated on the CPU, as on a GPU before sm_89"),
        ]
    kinds = ", ".join(sorted({f"{n} (sm_{a}{b})" for n, (a, b) in zip(node.names, node.capabilities)}))
    found = [Finding(OK, "GPUs", f"{node.gpus}: {kinds}; `launch/gpu_node.sh` runs the course over NCCL")]
    if min(node.capabilities) >= (8, 9):
        found.append(Finding(OK, "float8", "sm_89 or newer: float8 matmuls run on tensor cores"))
    else:
        found.append(
            Finding(
                NOTE,
                "float8",
                "older than sm_89: no float8 tensor cores, notebook 04's float8 runs emulated (correct, not faster)",
                "for float8's speed-up use an L40S, H100, H200 or newer",
            )
        )
    if node.gpus >= 2 and min(node.capabilities) >= (9, 0) and "NCCL_NVLS_ENABLE" not in os.environ:
        found.append(
            Finding(
                NOTE,
                "NVLS",
                "each NCCL communicator with NVLink SHARP reserves GPU memory; some notebooks hold several",
                "if NCCL init fails out of memory: export NCCL_NVLS_ENABLE=0",
            )
        )
    return found


def check_environment(node: Node) -> list[Finding]:
    env, found = os.environ, []
    if env.get(TF32_OVERRIDE, "") not in ("", "0"):
        found.append(
            Finding(
                PROBLEM,
                "TF32",
                f"{TF32_OVERRIDE}={env[TF32_OVERRIDE]} (NGC containers set it): with the "
                'course\'s fp32_precision="ieee" torch raises on its first matmul where a process keeps it',
                f"unset {TF32_OVERRIDE} before make course, jupyter lab or launch/*.sh",
            )
        )
    else:
        found.append(Finding(OK, "TF32", f"{TF32_OVERRIDE} unset"))
    if env.get("NVIDIA_TF32_OVERRIDE"):
        found.append(
            Finding(
                NOTE,
                "TF32",
                f"NVIDIA_TF32_OVERRIDE={env['NVIDIA_TF32_OVERRIDE']} changes cuBLAS and cuDNN behind torch's back",
                "unset NVIDIA_TF32_OVERRIDE",
            )
        )
    try:
        sockets = os.path.join(probe.socket_base(), probe.PRIVATE_PREFIX + "x" * 8, f"{probe.SOCKET_NAME}-65535")
        found.append(
            Finding(
                OK,
                "sockets",
                f"the course's kernels bind {len(sockets)} of zmq's "
                f"{probe.SOCKET_PATH_MAX} characters ({os.path.dirname(os.path.dirname(sockets))})",
            )
        )
    except ValueError as error:
        found.append(Finding(PROBLEM, "sockets", str(error).split("; ")[0], "export TMPDIR=/tmp"))
    from jupyter_core.paths import jupyter_runtime_dir

    home, runtime = env.get("HOME", ""), os.path.join(jupyter_runtime_dir(), f"kernel-{'0' * 36}-ipc-1")
    if len(runtime) > probe.SOCKET_PATH_MAX:
        found.append(
            Finding(
                NOTE,
                "HOME",
                f"{len(home)} characters: a kernel with IPC sockets in Jupyter's runtime "
                f"dir would need {len(runtime)} of zmq's {probe.SOCKET_PATH_MAX} (the course's kernels "
                "and JupyterLab's TCP kernels are not affected)",
                "for other tools that use IPC kernels: export JUPYTER_RUNTIME_DIR=/tmp/$USER-jupyter",
            )
        )
    else:
        found.append(Finding(OK, "HOME", f"{len(home)} characters: Jupyter's runtime dir fits zmq's limit too"))
    found.append(check_compiler(node))
    return found


def check_compiler(node: Node) -> Finding:
    """torch.compile's toolchain: Triton's C compiler on a GPU node, inductor's C++ one on CPU; Python's headers."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    names = ["cc", "gcc", "clang"] if node.gpus else ["g++", "c++", "clang++"]
    what = "Triton (torch.compile on CUDA)" if node.gpus else "inductor's C++ (torch.compile on CPU)"
    compiler = next((path for name in names if (path := shutil.which(name))), None)
    missing = [f"a compiler ({' or '.join(names)})"] if compiler is None else []
    missing += [] if headers.exists() else [f"Python's headers ({headers})"]
    if missing:
        return Finding(
            PROBLEM,
            "compile",
            f"{what} needs {' and '.join(missing)}: the cells that compile fail",
            "install gcc and python3-dev (or your Python's headers), or load their modules",
        )
    return Finding(OK, "compile", f"{what}: {compiler}, {headers} present")


def plan(node: Node, notebooks: list[Path]) -> tuple[list[tuple[str, str, str]], list[Finding]]:
    """(notebook, `make course`'s NPROC and backend, `gpu_node.sh`'s) for each notebook, with the runner's rules."""

    def one(path: Path) -> tuple[str, str, str]:
        defaults = runner.notebook_defaults(path)
        nproc = defaults.get("NPROC", "-")
        course = f"NPROC {nproc}, {runner.planned_backend(nproc, defaults.get('BACKEND', 'auto'))}"
        if not node.gpus:
            return path.stem, course, "- (no GPU)"
        try:
            chosen, refusal = probe.choose_nproc(path, node.gpus, {"BACKEND": "nccl"})
        except Exception as error:  # a ProbeError, a kernel that did not start
            return path.stem, course, f"FAILED: {error}"[:100]
        gpu = f"NPROC {chosen}, {runner.planned_backend(chosen, 'nccl')}" if chosen else f"skipped: {refusal}"[:100]
        return path.stem, course, gpu

    with ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) // 2))) as pool:
        rows = list(pool.map(one, notebooks))
    failed = [name for name, _, gpu in rows if gpu.startswith("FAILED")]
    found = (
        [
            Finding(
                PROBLEM,
                "notebooks",
                f"the setup cells of {', '.join(failed)} failed (in the table)",
                "run the notebook's first cells by hand to see why",
            )
        ]
        if failed
        else []
    )
    return rows, found


def check_bandwidth(node: Node) -> Finding:
    backend, size = ("nccl", 256 << 20) if node.gpus >= 2 else ("gloo", 16 << 20)
    try:
        busbw = all_reduce_busbw(backend, size)
    except Exception as error:  # a rank failed: NCCL, the GPUs, the network
        why = str(error)[:300]
        fix = "run it alone to see NCCL's own words: NCCL_DEBUG=INFO launch/check_node.sh --no-plan"
        return Finding(PROBLEM, "all-reduce", f"2 ranks over {backend} failed: {why}", fix)
    measured = f"2 ranks over {backend}, {size >> 20} MiB: bus bandwidth {busbw:.1f} GB/s"
    if backend == "gloo":
        return Finding(OK, "all-reduce", f"{measured} (CPU processes: for the record)")
    expected = link_bandwidth(node)
    if expected is None:
        return Finding(NOTE, "all-reduce", f"{measured}; the link's speed is unknown (no nvidia-smi topo)")
    if busbw < 0.4 * expected:
        fix = "look at nvidia-smi topo -m, NCCL_P2P_DISABLE and NCCL_SHM_DISABLE, other jobs on the GPUs"
        return Finding(NOTE, "all-reduce", f"{measured}: under 40% of the {expected:.0f} GB/s the link gives", fix)
    return Finding(OK, "all-reduce", f"{measured} of the {expected:.0f} GB/s the link should give")


def report(findings: list[Finding], rows: list[tuple[str, str, str]]) -> str:
    lines = []
    for f in findings:
        lines.append(f"  {f.status:<8} {f.topic:<11} {f.text}")
        if f.fix and f.status != OK:
            lines.append(f"  {'':<8} {'':<11} what to do: {f.fix}")
    if rows:
        width = max(len(name) for name, _, _ in rows)
        lines += ["", f"  {'notebook':<{width}}  {'make course':<16}  launch/gpu_node.sh"]
        lines += [f"  {name:<{width}}  {course:<16}  {gpu}" for name, course, gpu in rows]
    problems = sum(f.status == PROBLEM for f in findings)
    lines += ["", f"{problems} problem(s): fix them before class" if problems else "no problem found: the course runs"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch/check_node.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-plan", action="store_true", help="skip each notebook's NPROC (its setup cells)")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the 2-rank all-reduce")
    args = parser.parse_args(argv)
    start = time.monotonic()
    node = gather()
    findings = check_software(node) + check_gpus(node) + check_environment(node)
    rows: list[Any] = []
    if not args.no_plan:
        rows, found = plan(node, runner.find_notebooks([]))
        findings += found
    if not args.no_bandwidth:
        findings.append(check_bandwidth(node))
    print(f"check_node: can this machine run the course? ({time.monotonic() - start:.0f} s)\n")
    print(report(findings, rows))
    return 1 if any(f.status == PROBLEM for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
