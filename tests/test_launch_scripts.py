"""launch/: what each script runs, with fakes on PATH, and the runner choosing each notebook's NPROC.

The shell scripts run for real in a copy of launch/, with `make`, `srun`, `scontrol`, `.venv/bin/python`
and `.venv/bin/torchrun` replaced by programs that record their arguments (and the variables that
matter) and answer as a node with the given GPUs would. No rank starts. The runner's tests fake the GPU
count inside the probe's kernel (torch.cuda patched before the setup cells run), so the notebooks' own
`params.check` decides, as on a GPU node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from notebook_kit import fake_gpus_code, write_notebook

from course_lib.launch import spec as backend
from tools import probe, runner

ROOT = runner.ROOT
LAUNCH = ROOT / "launch"

# One program for every fake: it records what it was asked and answers as FAKE_GPUS GPUs would.
FAKE = """\
import json, os, sys
name = os.path.basename(sys.argv[0])
keep = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NPROC")
keep += ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"prog": name, "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}) + "\\n")
code = sys.argv[2] if sys.argv[1:2] == ["-c"] else ""
if "device_count" in code:
    print(os.environ.get("FAKE_GPUS", "0"))
elif "socket" in code:
    print(29999)
elif name == "scontrol":
    print("node001\\nnode002")
elif name == "make" and "--question" in sys.argv:
    sys.exit(int(os.environ.get("FAKE_STAMP_STALE", "0")))
elif name == "torchrun" and os.environ.get("FAKE_FAIL_VISIBLE", "-") == os.environ.get("CUDA_VISIBLE_DEVICES"):
    sys.exit(3)  # this "node" fails
"""


class Sandbox:
    """A copy of launch/ in an empty repository with a set-up .venv, the fakes on PATH."""

    def __init__(self, tmp: Path) -> None:
        self.repo, self.bin, self.log = tmp / "repo", tmp / "bin", tmp / "calls.jsonl"
        shutil.copytree(LAUNCH, self.repo / "launch")
        (self.repo / ".venv" / "bin").mkdir(parents=True)
        (self.repo / ".venv" / ".installed").touch()
        self.bin.mkdir()
        fakes = ("make", "srun", "scontrol", "module")
        for path in (*(self.bin / name for name in fakes), *self.venv("python", "torchrun")):
            path.write_text(f"#!{sys.executable}\n{FAKE}")
            path.chmod(0o755)

    def venv(self, *names: str) -> list[Path]:
        return [self.repo / ".venv" / "bin" / name for name in names]

    def run(self, script: str, *args: str, **env: str) -> tuple[int, list[dict], str]:
        """(exit status, the fakes' records in order, stderr) of `bash script args` in the repository."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        for name in ("CUDA_VISIBLE_DEVICES", "NPROC", "REFRESH_VENV", "PORT"):
            base.pop(name, None)
        base.update(PATH=f"{self.bin}{os.pathsep}{base['PATH']}", FAKE_LOG=str(self.log), **env)
        done = subprocess.run(
            ["bash", str(self.repo / script), *args],
            cwd=self.repo,
            env=base,
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return done.returncode, calls, done.stderr


@pytest.fixture
def sandbox(tmp_path):
    return Sandbox(tmp_path)


def runner_calls(calls: list[dict]) -> list[list[str]]:
    return [c["argv"][2:] for c in calls if c["prog"] == "python" and c["argv"][:2] == ["-m", "tools.runner"]]


# ---- launch/gpu_node.sh ----------------------------------------------------------------------------


def test_gpu_node_lets_each_notebook_take_the_nproc_it_accepts(sandbox):
    rc, calls, err = sandbox.run("launch/gpu_node.sh", "03", "05", FAKE_GPUS="4")
    assert rc == 0, err
    assert runner_calls(calls) == [
        ["--nproc-up-to", "4", "-p", "BACKEND", "nccl", "--out", "build/course-gpu", "03", "05"]
    ]


def test_gpu_node_forces_nproc_when_given(sandbox):
    rc, calls, err = sandbox.run("launch/gpu_node.sh", "03", FAKE_GPUS="8", NPROC="4")
    assert rc == 0, err
    assert runner_calls(calls) == [["-p", "NPROC", "4", "-p", "BACKEND", "nccl", "--out", "build/course-gpu", "03"]]


def test_gpu_node_without_gpus_points_to_make_course(sandbox):
    rc, calls, err = sandbox.run("launch/gpu_node.sh", FAKE_GPUS="0")
    assert rc == 1 and "make course" in err
    assert runner_calls(calls) == []


def test_gpu_node_uses_an_existing_venv_whose_stamp_is_stale(sandbox):
    """pip on a compute node often has no index to reach: a venv that exists is not reinstalled, unless asked."""
    makes = lambda calls: [c["argv"] for c in calls if c["prog"] == "make"]
    rc, calls, err = sandbox.run("launch/gpu_node.sh", FAKE_GPUS="2", FAKE_STAMP_STALE="1")
    assert rc == 0 and makes(calls) == [["--question", ".venv/.installed"]]
    assert "REFRESH_VENV=1" in err
    rc, calls, err = sandbox.run("launch/gpu_node.sh", FAKE_GPUS="2", FAKE_STAMP_STALE="1", REFRESH_VENV="1")
    assert rc == 0 and makes(calls) == [[".venv/.installed"]]
    (sandbox.repo / ".venv/.installed").unlink()  # no venv set up yet: make creates it
    rc, calls, err = sandbox.run("launch/gpu_node.sh", FAKE_GPUS="2")
    assert rc == 0 and makes(calls) == [[".venv/.installed"]]


def test_make_question_is_the_stamp_rule(tmp_path):
    """What gpu_node.sh asks of make: `make --question` says whether the venv's stamp is older than pyproject.toml."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / ".venv").mkdir()
    stamp = tmp_path / ".venv/.installed"
    stamp.touch()
    os.utime(tmp_path / "pyproject.toml", (stamp.stat().st_mtime + 10,) * 2)
    question = ["make", "--question", ".venv/.installed"]
    assert subprocess.run(question, cwd=tmp_path, capture_output=True).returncode == 1  # stale: would reinstall
    os.utime(stamp, (stamp.stat().st_mtime + 20,) * 2)
    assert subprocess.run(question, cwd=tmp_path, capture_output=True).returncode == 0


# ---- SLURM -----------------------------------------------------------------------------------------

SBATCH = sorted(LAUNCH.glob("*.sbatch"))


def sbatch_options(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", path.read_text(), flags=re.MULTILINE))


@pytest.mark.parametrize("path", SBATCH, ids=[p.name for p in SBATCH])
def test_sbatch_log_goes_where_slurm_can_write_it(path):
    """Slurm does not create the --output directory; build/ does not exist on a fresh clone (it is ignored)."""
    log = Path(sbatch_options(path)["output"])
    tracked = subprocess.run(["git", "ls-files", str(log.parent)], cwd=ROOT, capture_output=True, text=True).stdout
    assert log.parent == Path(".") or tracked, f"--output={log}: {log.parent}/ may not exist when the job starts"


def test_sbatch_course_has_time_for_every_notebook():
    hours, minutes, _ = (int(x) for x in sbatch_options(LAUNCH / "slurm_course.sbatch")["time"].split(":"))
    assert hours * 60 + minutes >= 120  # `make course` takes 21 minutes on 2 CPU cores; 8 NCCL ranks start slower


@pytest.mark.parametrize("gpus_on_node", ["8", None], ids=["gpus-set", "gpus-unset"])
def test_slurm_course_runs_gpu_node(sandbox, gpus_on_node):
    env = {"SLURM_SUBMIT_DIR": str(sandbox.repo), "SLURM_CPUS_PER_TASK": "32", "FAKE_GPUS": "8"}
    if gpus_on_node:
        env["SLURM_GPUS_ON_NODE"] = gpus_on_node
    rc, calls, err = sandbox.run("launch/slurm_course.sbatch", "05", **env)
    assert rc == 0, err
    assert runner_calls(calls) == [["--nproc-up-to", "8", "-p", "BACKEND", "nccl", "--out", "build/course-gpu", "05"]]
    assert {c["env"]["OMP_NUM_THREADS"] for c in calls if c["prog"] == "python"} == {"4"}


@pytest.mark.parametrize("gpus_on_node", ["4", None], ids=["gpus-set", "gpus-unset"])
def test_slurm_multinode_gives_srun_the_cpus(sandbox, gpus_on_node):
    env = {
        "SLURM_SUBMIT_DIR": str(sandbox.repo),
        "SLURM_CPUS_PER_TASK": "32",
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "77",
    }
    if gpus_on_node:
        env["SLURM_GPUS_ON_NODE"] = gpus_on_node
    rc, calls, err = sandbox.run("launch/slurm_multinode.sbatch", "job.py", **env)
    assert rc == 0, err
    (srun,) = [c for c in calls if c["prog"] == "srun"]
    argv = srun["argv"]
    assert "--cpus-per-task=32" in argv[: argv.index(".venv/bin/torchrun")], argv  # srun's option, not torchrun's
    torchrun = argv[argv.index(".venv/bin/torchrun") + 1 :]
    gpus = gpus_on_node or "8"  # the header's --gpus-per-node
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == gpus
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == f"node001:{15000 + 77}"  # the job's own port
    assert torchrun[-1] == "job.py"
    assert srun["env"]["OMP_NUM_THREADS"] == str(32 // int(gpus))


def test_slurm_multinode_can_restart_and_loads_the_modules_asked_for(sandbox):
    env = {
        "SLURM_SUBMIT_DIR": str(sandbox.repo),
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "123456",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",  # as in NGC containers
        "COURSE_MODULES": "python/3.11 cuda/12.8",
        "RDZV_PORT": "23456",
    }
    rc, calls, err = sandbox.run("launch/slurm_multinode.sbatch", "job.py", **env)
    assert rc == 0, err
    assert [c["argv"] for c in calls if c["prog"] == "module"] == [["load", "python/3.11", "cuda/12.8"]]
    (srun,) = [c for c in calls if c["prog"] == "srun"]
    argv = srun["argv"]
    assert argv[argv.index("--max-restarts") + 1] == "3"
    # without it, a restarted group would meet on torchrun's shared store and runtime.init_distributed refuses that
    assert srun["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert srun["env"]["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] is None
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node001:23456"
    env.pop("RDZV_PORT")
    rc, calls, err = sandbox.run("launch/slurm_multinode.sbatch", "job.py", **env)
    (srun,) = [c for c in calls if c["prog"] == "srun"]
    port = int(srun["argv"][srun["argv"].index("--rdzv-endpoint") + 1].split(":")[1])
    assert rc == 0 and port == 15000 + 123456 % 15000 and port < 32768, (rc, err, port)


def test_slurm_course_loads_no_module_unless_asked(sandbox):
    env = {"SLURM_SUBMIT_DIR": str(sandbox.repo), "FAKE_GPUS": "8"}
    rc, calls, err = sandbox.run("launch/slurm_course.sbatch", "05", **env)
    assert rc == 0 and not [c for c in calls if c["prog"] == "module"], (rc, err)
    rc, calls, err = sandbox.run("launch/slurm_course.sbatch", "05", COURSE_MODULES="python/3.11", **env)
    assert rc == 0 and [c["argv"] for c in calls if c["prog"] == "module"] == [["load", "python/3.11"]], (rc, err)


# ---- launch/multinode_local.sh ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "visible", "expected"),
    [
        ("0", None, [None, None]),  # a CPU machine: nothing changes
        ("1", None, ["", ""]),  # one GPU cannot be halved: both nodes on CPU, neither shares it
        ("4", None, ["0,1", "2,3"]),
        ("8", None, ["0,1,2,3", "4,5,6,7"]),
        ("4", "4,5,6,7", ["4,5", "6,7"]),  # the devices this job was given, by their names
    ],
    ids=["cpu", "1-gpu", "4-gpus", "8-gpus", "4-of-8-visible"],
)
def test_multinode_local_nodes_do_not_share_gpus(sandbox, gpus, visible, expected):
    env = {"FAKE_GPUS": gpus, **({"CUDA_VISIBLE_DEVICES": visible} if visible else {})}
    rc, calls, err = sandbox.run("launch/multinode_local.sh", "job.py", **env)
    assert rc == 0, err
    agents = [c for c in calls if c["prog"] == "torchrun"]
    assert len(agents) == 2 and all(a["argv"][-1] == "job.py" and "--nnodes" in a["argv"] for a in agents)
    assert sorted(a["env"]["CUDA_VISIBLE_DEVICES"] for a in agents if a["env"]["CUDA_VISIBLE_DEVICES"] is not None) == [
        e for e in expected if e is not None
    ]
    assert sum(a["env"]["CUDA_VISIBLE_DEVICES"] is None for a in agents) == expected.count(None)


def test_multinode_local_drops_the_tf32_override(sandbox):
    env = {"FAKE_GPUS": "4", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}  # as in NGC containers
    rc, calls, err = sandbox.run("launch/multinode_local.sh", "job.py", **env)
    agents = [c for c in calls if c["prog"] == "torchrun"]
    assert rc == 0 and len(agents) == 2, (rc, err)
    assert all(a["env"]["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] is None for a in agents)


def test_multinode_local_fails_when_a_node_fails(sandbox):
    rc, calls, err = sandbox.run("launch/multinode_local.sh", "job.py", FAKE_GPUS="4", FAKE_FAIL_VISIBLE="2,3")
    assert rc == 3 and len([c for c in calls if c["prog"] == "torchrun"]) == 2, (rc, err)


# ---- the runner: each notebook at the largest NPROC it accepts up to G ------------------------------


@pytest.fixture
def fake_node(monkeypatch):
    """fake_node(G): the probe's kernels and the runner see G GPUs; papermill is not run. Returns its calls."""
    ran: list[tuple[str, dict]] = []
    original = probe.start_kernel

    def fake(gpus: int) -> list[tuple[str, dict]]:
        def kernel(cwd, tmp):
            k = original(cwd, tmp)
            assert k.run(fake_gpus_code(gpus))[0] == ""
            return k

        def run_notebook(path, output, parameters, timeout, progress):
            ran.append((path.stem, parameters))
            return runner.Outcome(path.stem, "ok", 0.0)

        monkeypatch.setattr(probe, "start_kernel", kernel)
        monkeypatch.setattr(runner, "run_notebook", run_notebook)
        monkeypatch.setattr(backend, "available_gpus", lambda: gpus)
        return ran

    return fake


def table_row(table: str, notebook: str) -> list[str]:
    (row,) = [line for line in table.splitlines() if line.startswith(notebook + " ")]
    return row.split(None, 5)


def test_runner_on_8_gpus_runs_notebook_05_at_6(fake_node, tmp_path, capsys):
    """05 splits 12 heads over the ranks (NPROC in 1, 2, 3, 4, 6): 8 and 7 are refused, 6 is the largest."""
    ran = fake_node(8)
    argv = ["05", "--nproc-up-to", "8", "-p", "BACKEND", "nccl", "--out", str(tmp_path), "--no-progress"]
    assert runner.main(argv) == 0
    assert ran == [("05_activation_memory", {"BACKEND": "nccl", "NPROC": 6})]
    table = capsys.readouterr().out
    assert table_row(table, "05_activation_memory")[:4] == ["05_activation_memory", "ok", "6", "nccl"]
    assert "notebook              status   NPROC  backend  seconds  failure" in table


def test_runner_on_1_gpu_skips_notebook_08_with_its_reason(fake_node, tmp_path, capsys):
    """08 needs 2 ranks: on one GPU it is skipped, naming the values that work, and the run still passes."""
    ran = fake_node(1)
    argv = ["08", "--nproc-up-to", "1", "-p", "BACKEND", "nccl", "--out", str(tmp_path), "--no-progress"]
    assert runner.main(argv) == 0
    assert ran == []
    table = capsys.readouterr().out
    name, status, nproc, backend_name, _, reason = table_row(table, "08_tensor_parallel")
    assert (status, nproc, backend_name) == ("skipped", "-", "-")
    assert reason.startswith("NPROC=1 does not work in this notebook") and "that work: 2, 3, 4, 6" in reason
    assert "0 passed, 0 failed, 1 skipped" in table


PARAMETERS = 'NPROC = 1\nBACKEND = "auto"'
CHECK = "from course_lib import params\nNPROC = params.check(NPROC, BACKEND, works=lambda n: {works}, why={why!r})"


def test_runner_runs_small_notebooks_at_their_chosen_nproc(monkeypatch, tmp_path, capsys):
    """End to end with no GPU (gloo): one runs at the NPROC it chose (then fails), one is skipped."""
    monkeypatch.setattr(backend, "available_gpus", lambda: 0)  # the table's backend column
    even = write_notebook(
        tmp_path / "97_even.ipynb",
        PARAMETERS,
        CHECK.format(works="n % 2 == 0", why="pairs"),
        "print('RAN', NPROC)",
        "raise KeyError(NPROC)",
    )
    many = write_notebook(tmp_path / "96_many.ipynb", PARAMETERS, CHECK.format(works="n > 5", why="six at least"))
    out = tmp_path / "out"
    assert runner.main([str(even), str(many), "--nproc-up-to", "3", "--out", str(out), "--no-progress"]) == 1
    table = capsys.readouterr().out
    executed = nbformat.read(out / even.name, as_version=4)
    assert "RAN 2" in "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert table_row(table, "97_even")[:4] == ["97_even", "FAILED", "2", "gloo"]
    assert "cell 5: KeyError" in table  # papermill's injected parameters are cell 2
    skipped = table_row(table, "96_many")
    assert skipped[1] == "skipped" and "six at least" in skipped[5] and "that work: 6, 7, 8" in skipped[5]
    assert "0 passed, 1 failed, 1 skipped" in table


def test_runner_without_the_option_asks_no_probe(monkeypatch, tmp_path, capsys):
    """Without --nproc-up-to the runner runs what it is given, as before, and shows NPROC and backend."""
    path = write_notebook(tmp_path / "94_plain.ipynb", PARAMETERS, "pass")
    ran = []
    monkeypatch.setattr(probe, "start_kernel", lambda cwd, tmp: pytest.fail("probed without --nproc-up-to"))
    monkeypatch.setattr(
        runner,
        "run_notebook",
        lambda path, out, parameters, t, p: ran.append(parameters) or runner.Outcome("94_plain", "ok", 0),
    )
    monkeypatch.setattr(backend, "available_gpus", lambda: 0)
    assert runner.main([str(path), "-p", "NPROC", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    assert ran == [{"NPROC": 4}]
    assert table_row(capsys.readouterr().out, "94_plain")[:4] == ["94_plain", "ok", "4", "gloo"]  # BACKEND: its default


@pytest.mark.parametrize(
    "argv",
    [["--nproc-up-to", "4", "-p", "NPROC", "2"], ["--nproc-up-to", "0"], ["--nproc-up-to", "2", "--inplace"]],
    ids=["with-nproc", "zero", "inplace"],
)
def test_runner_refuses_contradictory_options(argv):
    with pytest.raises(SystemExit) as stop:
        runner.main(["00", *argv])
    assert stop.value.code == 2


def test_a_notebook_without_a_parameter_check_fails_with_the_reason(tmp_path, capsys):
    path = write_notebook(tmp_path / "93_unchecked.ipynb", "NPROC = 2", "print(NPROC)")
    assert runner.main([str(path), "--nproc-up-to", "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    row = table_row(capsys.readouterr().out, "93_unchecked")
    assert row[1] == "FAILED" and row[5].startswith("cannot choose NPROC: ") and "params.check" in row[5]
