"""launch/check_node.sh: on this machine it reports the CPU course and passes; faked problems come with their fix.

GPUs are faked as in tests/test_gpu_counts.py and tests/device_fakes.py: torch.cuda's answers patched here, and in
the probe's kernels (notebook_kit.fake_gpus_code) where each notebook's own check chooses its NPROC.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from notebook_kit import fake_gpus_code

from tools import node, preflight, probe, runner


def by_topic(findings, topic):
    return [f for f in findings if f.topic == topic]


def test_check_node_on_this_machine_reports_the_cpu_course_and_passes():
    done = subprocess.run(  # the timeout guards against a hang; the preflight prints its own time
        ["bash", str(runner.ROOT / "launch/check_node.sh")], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "no problem found: the course runs" in out and "PROBLEM" not in out
    assert "none: the CPU course, `make course`" in out  # this machine has no GPU
    assert "2 ranks over gloo, 16 MiB: bus bandwidth" in out
    for path in runner.find_notebooks([]):
        (row,) = [line.split() for line in out.splitlines() if line.strip().startswith(path.stem + " ")]
        assert row[1:4] == ["NPROC", f"{runner.notebook_defaults(path)['NPROC']},", "gloo"], row


@pytest.fixture
def eight_gpus(monkeypatch):
    """torch here says 8 H100s (sm_90) and NCCL 2.28.9; the probe's kernels say 8 GPUs too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    original = probe.start_kernel

    def kernel(cwd, tmp):
        k = original(cwd, tmp)
        assert k.run(fake_gpus_code(8))[0] == ""
        return k

    monkeypatch.setattr(probe, "start_kernel", kernel)


def test_on_eight_faked_gpus_it_reports_them_and_gpu_node_sh_s_choice(eight_gpus):
    machine = node.gather()
    assert (machine.gpus, machine.nccl, machine.capabilities[0]) == (8, "2.28.9", (9, 0))
    gpus = {f.topic: f for f in preflight.check_gpus(machine)}
    assert gpus["GPUs"].status == "ok" and "8: NVIDIA H100 80GB HBM3 (sm_90)" in gpus["GPUs"].text
    assert gpus["float8"].status == "ok" and "tensor cores" in gpus["float8"].text
    assert "NCCL_NVLS_ENABLE=0" in gpus["NVLS"].fix
    rows, found = preflight.plan(machine, runner.find_notebooks(["00", "05"]))
    assert found == []
    assert rows == [
        ("00_torchrun_and_process_groups", "NPROC 2, nccl", "NPROC 8, nccl"),
        ("05_activation_memory", "NPROC 2, nccl", "NPROC 6, nccl"),  # 05 needs NPROC to divide 12
    ]


def test_a_gpu_before_sm_89_gets_float8_emulated_and_a_gpu_node_needs_a_c_compiler(eight_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    machine = node.gather()
    (float8,) = by_topic(preflight.check_gpus(machine), "float8")
    assert float8.status == "note" and "emulated" in float8.text
    monkeypatch.setenv("PATH", "")  # no cc, gcc or clang
    compile_ = preflight.check_compiler(machine)
    assert compile_.status == "PROBLEM" and "Triton" in compile_.text and "cc or gcc or clang" in compile_.text
    assert "install gcc" in compile_.fix


def test_a_tf32_override_is_a_problem_with_its_fix(monkeypatch, capsys):
    monkeypatch.setenv(preflight.TF32_OVERRIDE, "1")  # as NGC containers set it
    (tf32,) = by_topic(preflight.check_environment(node.gather()), "TF32")
    assert tf32.status == "PROBLEM" and f"unset {preflight.TF32_OVERRIDE}" in tf32.fix
    assert preflight.main(["--no-plan", "--no-bandwidth"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  TF32" in out and f"what to do: unset {preflight.TF32_OVERRIDE}" in out
    assert "1 problem(s): fix them before class" in out


def test_a_long_home_is_reported_with_its_fix_and_does_not_stop_the_course(tmp_path, monkeypatch):
    home = tmp_path / ("a-cluster-home-" + "h" * 60)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "XDG_DATA_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    found = {f.topic: f for f in preflight.check_environment(node.gather())}
    assert found["HOME"].status == "note" and f"{len(str(home))} characters" in found["HOME"].text
    assert "JUPYTER_RUNTIME_DIR" in found["HOME"].fix
    assert found["sockets"].status == "ok"  # the runner's kernels: test_runner_kernel.py runs one under such a HOME


def test_gpus_that_torch_cannot_see_and_an_old_driver_are_problems():
    cpu_build = node.Node(torch_version=torch.__version__, cuda=None, nccl=None, gpus=0, smi_gpus=8, driver="580.1")
    (gpus,) = by_topic(preflight.check_software(cpu_build), "GPUs")
    assert gpus.status == "PROBLEM" and "torch sees none" in gpus.text and "CUDA build" in gpus.fix
    old = node.Node(torch.__version__, "13.0", "2.28.9", 8, ["H100"] * 8, [(9, 0)] * 8, driver="550.54", smi_gpus=8)
    (driver,) = by_topic(preflight.check_software(old), "driver")
    assert driver.status == "PROBLEM" and "older than CUDA 13.0 needs (580.0)" in driver.text
