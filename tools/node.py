"""What this machine has, for the preflight (tools.preflight): torch, its GPUs, the driver, the link
between GPUs 0 and 1, and a 2-rank all-reduce's bus bandwidth measured with the course's own launcher.

nvidia-smi answers what torch does not (the driver, the topology, PCIe's generation); without it those are None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

LINK_GBPS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # PCIe GB/s per lane and direction, by generation


@dataclass
class Node:
    """What torch and nvidia-smi say about this machine (tests build one with faked GPUs)."""

    torch_version: str
    cuda: str | None  # torch's CUDA build, None for a CPU build
    nccl: str | None
    gpus: int
    names: list[str] = field(default_factory=list)
    capabilities: list[tuple[int, int]] = field(default_factory=list)
    driver: str | None = None  # nvidia-smi's, None without one
    smi_gpus: int = 0  # the GPUs nvidia-smi lists (torch may see none of them)


def nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, "" where it is missing or fails."""
    if not shutil.which("nvidia-smi"):
        return ""
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=False)
    return done.stdout if done.returncode == 0 else ""


def gather() -> Node:
    import torch

    from course_lib.launch.spec import available_gpus

    gpus = available_gpus()
    nccl = None
    if gpus:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    drivers = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split()
    return Node(
        torch_version=torch.__version__,
        cuda=torch.version.cuda,
        nccl=nccl,
        gpus=gpus,
        names=[torch.cuda.get_device_name(i) for i in range(gpus)],
        capabilities=[tuple(torch.cuda.get_device_capability(i)) for i in range(gpus)],  # type: ignore[misc]
        driver=drivers[0] if drivers else None,
        smi_gpus=len(drivers),
    )


def link_bandwidth(node: Node) -> float | None:
    """What the link between GPUs 0 and 1 should give per direction, GB/s (nvidia-smi topo), None if unknown."""
    topo = nvidia_smi("topo", "-m")
    row = next((line.split() for line in topo.splitlines() if line.startswith("GPU0")), [])
    if len(row) > 2 and (links := re.fullmatch(r"NV(\d+)", row[2])):
        return int(links.group(1)) * (50.0 if min(node.capabilities) >= (10, 0) else 25.0)
    gen_width = nvidia_smi("--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader", "-i", "0")
    numbers = [int(n) for n in re.findall(r"\d+", gen_width)]
    return LINK_GBPS[numbers[0]] * numbers[1] if len(numbers) == 2 and numbers[0] in LINK_GBPS else None


BENCHMARK = """
from course_lib.collectives.lab import benchmark
from course_lib.launch.runtime import rank_device
rows = benchmark([SIZE], ["all_reduce"], repeats=5, device=rank_device())
"""


def all_reduce_busbw(backend: str, size: int) -> float:
    """The bus bandwidth (GB/s, nccl-tests' convention) of 2 ranks all-reducing `size` bytes over `backend`.

    The ranks start as a %%torchrun cell's do (launch(): OMP_NUM_THREADS set, gloo ranks blind to GPUs, NCCL
    ranks on GPUs 0 and 1); the time is the median of 5 after a warm-up (collectives.lab.benchmark).
    """
    from course_lib.launch.launcher import launch

    result = launch(
        BENCHMARK, 2, backend=backend, push={"SIZE": size}, out=("rows",), timeout=120, write=lambda text, stream: None
    )
    return float(result.values["rows"][0][0]["busbw"]) / 1e9
