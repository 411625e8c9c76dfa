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
    from course_lib.fault_tolerance import lab
    from course_lib.launch import spec as backend

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
    from course_lib.launch.spec import LaunchError, visible_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(LaunchError, match="GPU 1 is not among the 1"):
        visible_gpu(1)


@pytest.mark.parametrize(("gpus", "hidden"), [(0, ""), (2, ""), (8, None)], ids=["cpu", "2-gpus", "8-gpus"])
def test_a_torchrun_started_by_hand_gets_what_a_cell_gives_its_ranks(monkeypatch, gpus, hidden):
    """Notebook 00's subprocess job: 4 gloo ranks on 2 GPUs see none; on 8 they are NCCL ranks and see them."""
    from course_lib.launch import spec as backend
    from course_lib.launch import torchrun_env

    monkeypatch.setattr(backend, "available_gpus", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    env = torchrun_env(4, "auto")
    assert env.get("CUDA_VISIBLE_DEVICES") == hidden
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE" not in env
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "


# ---- float8: torchao's real recipe where the GPU has float8 tensor cores ------------------------------------------


@pytest.mark.parametrize(
    ("capability", "real"),
    [((7, 0), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((12, 0), True)],
    ids=["V100", "A100", "A10", "L4-Ada", "H100", "Blackwell"],
)
def test_float8_recipe_is_real_from_sm89_and_emulated_below(monkeypatch, capability, real):
    import torch

    from course_lib import precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    recipe = precision.float8_recipe(torch.device("cuda", 0))
    assert recipe.emulate is not real and recipe.enable_fsdp_float8_all_gather
    assert recipe.pad_inner_dim is real  # a rank's rows (48 / NPROC) are rarely a multiple of 16
    assert recipe.gemm_config_output.use_fast_accum  # torchao's default, kept
    assert precision.float8_recipe(torch.device("cpu")).emulate


# One rank of a gloo group, the SM89+ branch forced: torch's CPU scaled_mm runs the matmuls a GPU's float8 tensor
# cores would, and every call is recorded. 40 rows per step: not a multiple of 16.
REAL_RECIPE_ON_CPU = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[2])
from course_lib.precision import float8, float8_width, rank_batches
if sys.argv[1] == "real":
    float8.float8_tensor_cores = lambda device: True
shapes, scaled_mm = [], torch._scaled_mm
def recording(a, b, *args, **kwargs):
    shapes.append((tuple(a.shape), tuple(b.shape)))
    return scaled_mm(a, b, *args, **kwargs)
torch._scaled_mm = recording
cpu = torch.device("cpu")
run = float8.train_fsdp("float8", rank_batches(3, 40, cpu), width=float8_width(1), lr=2.0, device=cpu)
print(json.dumps({"shapes": shapes, "emulated": run["emulated"], "losses": run["losses"],
                  "modules": run["float8_modules"], "scales_ok": run["scales_are_max_over_amax"]}))
dist.destroy_process_group()
"""


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_real_float8_recipe_calls_scaled_mm_with_dims_cuda_accepts_and_learns_as_emulation():
    import json

    runs = {}
    for kind in ("emulated", "real"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        code = [sys.executable, "-c", REAL_RECIPE_ON_CPU, kind, free_port()]
        done = subprocess.run(code, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    emulated, real = runs["emulated"], runs["real"]
    assert emulated["shapes"] == [] and all(emulated["emulated"])
    assert not any(real["emulated"]) and real["scales_ok"] and len(real["modules"]) == 2
    assert len(real["shapes"]) == 3 * 2 * 3  # steps x float8 Linears x (output, grad input, grad weight)
    # CUDA's scaled_mm wants K and N multiples of 16: the weight gradient's K is the 40 rows, padded to 48
    assert all(a[1] % 16 == 0 and b[1] % 16 == 0 for a, b in real["shapes"]), real["shapes"]
    assert any(a[1] == 48 for a, _ in real["shapes"])
    tolerance = 2.0**-4 * emulated["losses"][0]  # notebook 04's bound between float8 and bf16, here the two float8s
    assert max(abs(a - b) for a, b in zip(real["losses"], emulated["losses"])) < tolerance


# ---- the capstone's MFU: against the bf16 dense peak of the GPU it runs on -------------------------------------


def test_mfu_divides_by_the_bf16_dense_peak_of_the_gpu_and_a_cpu_gets_none(monkeypatch):
    import torch

    from course_lib import gpt
    from course_lib.gpt import lab

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert gpt.device_peak_flops("cuda:0") == 989e12 and gpt.device_peak_flops("cpu") is None
    summary = {"seconds_per_step": 2.0, "flops_per_step": 2 * 98.9e12, "tokens_per_step": 1024, "limit_flops": 5e13}
    assert lab.achieved({**summary, "peak_flops": 989e12})["mfu"] == pytest.approx(0.1)
    assert lab.achieved({**summary, "peak_flops": 0.0})["mfu"] == 0.0  # a CPU: no MFU, the limit column instead


# ---- what a `%%torchrun` cell says it got, on a GPU node ---------------------------------------------------------


def test_a_no_init_cell_does_not_claim_a_backend(monkeypatch, capsys):
    """Notebook 12's RPC cells (`--no-init`) on a node of 2 GPUs: 'auto' resolves to nccl, which no one sets up."""
    from IPython.core.interactiveshell import InteractiveShell

    from course_lib.launch import spec as backend

    monkeypatch.setattr(backend, "available_gpus", lambda: 2)
    assert backend.describe_backend("nccl", 2) == "backend nccl: 2 ranks, one GPU each (2 on this node)\n"
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_lib")
    capsys.readouterr()
    ip.run_cell_magic("torchrun", "-n 2 --no-init", "print('no group here')\n")
    said = capsys.readouterr().out
    assert said.startswith("--no-init: 2 ranks, no process group made for them, the node's GPUs visible to them")
    assert "nccl" not in said and "one GPU each" not in said and said.count("no group here") == 2


# ---- notebook 14's NCCL timeout under TORCH_NCCL_BLOCKING_WAIT=1 -------------------------------------------------


def test_a_rank_whose_blocking_wait_raises_lets_the_watchdog_finish_its_dump(tmp_path, monkeypatch):
    """The rank's script, with fakes: its second all-reduce raises at the call (the blocking wait's timeout) while
    another thread (the watchdog's) writes the flight recorder's dump half a second later; the exception must not
    end the rank before the dump is there."""
    import threading
    import time
    import types

    from course_lib.debugging import lab

    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "rank_"))
    dump = tmp_path / "rank_0"

    class DistBackendError(RuntimeError):
        pass

    calls = []

    def all_reduce(x, group=None):
        calls.append(group)
        if len(calls) == 2:
            threading.Timer(0.5, dump.write_bytes, args=(b"entries",)).start()
            raise DistBackendError("Watchdog caught collective operation timeout")

    fake_dist = types.SimpleNamespace(new_group=lambda timeout: "group 1", all_reduce=all_reduce)
    fake_torch = types.SimpleNamespace(ones=lambda *a, **k: None, cuda=types.SimpleNamespace(synchronize=lambda: None))
    names = {"dist": fake_dist, "torch": fake_torch, "device": "cuda:0", "rank": 0, "world_size": 2, "TIMEOUT_S": 1}
    start = time.monotonic()
    with pytest.raises(DistBackendError):
        exec(lab.STUCK_ALL_REDUCE, names)
    assert calls == ["group 1", "group 1"] and dump.read_bytes() == b"entries"
    assert time.monotonic() - start >= 1.4  # the dump's 0.5 s, then a second for its last bytes
