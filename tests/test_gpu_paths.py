"""Branches that run only on GPUs, proven on the CPU: torch's TF32 flags under NGC's override, the GPU a node
takes under an inherited CUDA_VISIBLE_DEVICES, and the float8 recipe a GPU of SM89+ gets (capability faked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# ---- TF32: float32 means float32, even with TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (NGC containers) ----------------

# Reading the legacy flags runs the same checks as every float32 cuBLAS matmul (Context::allowTF32CuBLAS) and the
# cuDNN flag's reader; torch reads the override once, when it loads, so each case runs in a process of its own.
READ_FLAGS = """
import torch
{setup}
flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
print(flags, torch.backends.cuda.matmul.fp32_precision)
"""

# init_distributed's nccl branch, on the CPU: the calls that need a GPU or other ranks do nothing
FAKE_NCCL_INIT = """
import torch.distributed as dist
from course_lib.launch import runtime
torch.cuda.set_device = lambda device: None
dist.init_process_group = lambda *args, **kwargs: None
dist.get_rank, dist.get_world_size = (lambda group=None: 0), (lambda group=None: 1)
runtime.resolve_backend = lambda requested, nproc: "nccl"
assert runtime.init_distributed("nccl", seed=None).backend == "nccl"
"""


def read_flags(setup: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "PYTHONPATH": str(ROOT)}
    code = READ_FLAGS.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "setup",
    ["from course_lib.launch.runtime import fp32_in_ieee\nfp32_in_ieee()", FAKE_NCCL_INIT],
    ids=["fp32_in_ieee", "init_distributed-nccl"],
)
def test_fp32_is_ieee_and_readable_under_the_tf32_override(setup):
    done = read_flags(setup)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(False, False) ieee"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ('torch.backends.cuda.matmul.fp32_precision = "ieee"', "cublas matmul"),  # what the ranks did before
        ('torch.backends.cudnn.fp32_precision = "ieee"', "cuDNN"),  # the latent one: without the override too
    ],
    ids=["matmul", "cudnn"],
)
def test_the_new_flag_alone_trips_torchs_mixed_api_check(setup, message):
    """Why fp32_in_ieee sets both kinds of flag: either new-API setter alone leaves a reader that raises."""
    done = read_flags(setup)
    assert done.returncode != 0 and "mix of" in done.stderr and message in done.stderr, done.stderr[-800:]


# ---- which GPUs a child process sees ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inherited", "expected"),
    [(None, ["0", "1"]), ("4,5,6,7", ["4", "5"]), ("GPU-aa, GPU-bb", ["GPU-aa", "GPU-bb"])],
    ids=["no-mask", "slurm-share", "uuids"],
)
def test_each_elastic_node_takes_its_own_gpu_of_those_the_kernel_sees(monkeypatch, inherited, expected):
    from course_lib.checkpoint import lab
    from course_lib.launch import backend

    monkeypatch.setattr(backend, "available_gpus", lambda: 4)  # resolve_backend asks torch.cuda otherwise
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    nodes = [lab._node(i, "pass", "nccl", "127.0.0.1:29400", "test", 0, 30.0) for i in range(2)]
    try:
        assert [node.spec.env["CUDA_VISIBLE_DEVICES"] for node in nodes] == expected
    finally:
        for node in nodes:
            node.run.remove()


def test_a_gpu_beyond_the_inherited_mask_is_refused(monkeypatch):
    from course_lib.launch.backend import LaunchError, visible_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(LaunchError, match="GPU 1 is not among the 1"):
        visible_gpu(1)


@pytest.mark.parametrize(("gpus", "hidden"), [(0, ""), (2, ""), (8, None)], ids=["cpu", "2-gpus", "8-gpus"])
def test_a_torchrun_started_by_hand_gets_what_a_cell_gives_its_ranks(monkeypatch, gpus, hidden):
    """Notebook 00's subprocess job: 4 gloo ranks on 2 GPUs see none; on 8 they are NCCL ranks and see them."""
    from course_lib.launch import backend, torchrun_env

    monkeypatch.setattr(backend, "available_gpus", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    env = torchrun_env(4, "auto")
    assert env.get("CUDA_VISIBLE_DEVICES") == hidden
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE" not in env
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "
