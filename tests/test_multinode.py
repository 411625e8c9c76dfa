"""Two torchrun agents on this machine form one job of four ranks (c10d rendezvous on 127.0.0.1)."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from pathlib import Path

from course_lib.launch import launch, standalone_script

ROOT = Path(__file__).resolve().parent.parent
BODY = "t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nprint(f'rank {rank} of {world_size}: sum {t.item():g}')\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_run_a_saved_cell_as_one_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(standalone_script(BODY, backend="gloo", nproc=2))
    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "multinode_local.sh"), str(script)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = sorted(set(re.findall(r"rank (\d) of (\d): sum (\S+)", done.stdout)))
    assert lines == [(str(r), "4", "6") for r in range(4)], done.stdout


def test_magic_passes_multi_node_flags_through():
    port, results, errors = free_port(), [], []

    def node():
        try:
            results.append(
                launch(
                    BODY + "mine = (rank, t.item())\n",
                    2,
                    backend="gloo",
                    nnodes="2",
                    rdzv_backend="c10d",
                    rdzv_endpoint=f"127.0.0.1:{port}",
                    rdzv_id="pass-through",
                    out=["mine"],
                    write=lambda text, stream: None,
                    timeout=120,
                )
            )
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    nodes = [threading.Thread(target=node) for _ in range(2)]
    for n in nodes:
        n.start()
    for n in nodes:
        n.join()
    assert errors == []
    gathered = sorted(v for r in results for v in r.values["mine"])
    assert gathered == [(r, 6.0) for r in range(4)]
    for r in results:  # each agent reports its own node's ranks, in rank order
        ranks = [v[0] for v in r.values["mine"]]
        assert ranks == sorted(ranks) and len(ranks) == 2
