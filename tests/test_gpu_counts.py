"""Every notebook at NPROC 1 to 8 on 0, 1, 2, 4 and 8 GPUs, proven without one: the GPU count is faked in the kernel.

For each notebook, one kernel is told it has G CUDA devices (torch.cuda.is_available and
device_count patched before anything runs), then runs the parameters cell with NPROC and BACKEND
injected as papermill does, and the setup cells: they accept NPROC, or refuse it at once with a
ParameterError that names nccl (too few GPUs) or every NPROC from 1 to 8 that works. Where the
notebook accepts them, every distributed cell of the notebook (each `%%torchrun` and `%dist start`
line, each launch(...), check(...) and the other calls that start ranks) is resolved there as it
would be when run: its rank count and backend must be able to run on G GPUs (nccl only when its
ranks fit, one GPU each), its gloo ranks must see no GPU, and a cell of NPROC ranks on the
notebook's BACKEND must get the GPUs when they are enough. No rank starts. With the notebooks at
other NPROCs, in `make test-ranks` (marked `sweep`).
"""

from __future__ import annotations

import ast

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from notebook_kit import fake_gpus_code

from course_lib import params
from tools import probe, runner

NOTEBOOKS = runner.find_notebooks([])
GPU_COUNTS = (0, 1, 2, 4, 8)
# Calls that start ranks: the argument that gives the rank count (position, keyword) and the backend's keyword.
RANK_CALLS = {"launch": (1, "nproc"), "check": (None, "nproc"), "diagnose_hang": (1, "nproc")}


def rank_sites(nb) -> list[tuple[int, str, object]]:
    """(cell index, kind, what to resolve) for every place in the notebook that starts ranks."""
    transform = TransformerManager().transform_cell
    sites: list[tuple[int, str, object]] = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(transform(cell.source))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            args = [ast.unparse(a) for a in node.args]
            if name in ("run_cell_magic", "run_line_magic") and args[0] in ("'torchrun'", "'dist'"):
                line = ast.literal_eval(args[1])
                if args[0] == "'torchrun'" or line.split()[0] in ("start", "restart"):
                    sites.append((index, args[0].strip("'"), line))
            elif name in RANK_CALLS:
                position, keyword = RANK_CALLS[name]
                nproc = keywords.get(keyword) or (args[position] if position is not None else None)
                if nproc is not None:
                    sites.append((index, "call", (nproc, keywords.get("backend", "'auto'"), None)))
            elif name == "run_elastic":
                sites.append((index, "call", ("2", keywords["backend"], None)))
            elif name == "nccl_timeout":
                sites.append((index, "call", (args[0], "'nccl'", "not ON_GLOO")))
    return sites


# Runs in the kernel after the setup cells: raises AssertionError naming every cell that could not run.
RESOLVE_SITES = """
def _resolve_sites(sites, gpus, requested):
    import re
    import shlex
    from course_lib.launch.magic import parse_flags
    from course_lib.launch.processes import agent_env
    from course_lib.launch.spec import RunSpec
    from course_lib.session.magic import PARSER

    ip, problems, seen = get_ipython(), [], 0
    for cell, kind, what in sites:
        try:
            if kind == "torchrun":
                flags = parse_flags(ip.var_expand(re.sub(r"--save \\S+", "", what)))  # a path set later
                asked_nproc = "$NPROC" in what.split() and "$BACKEND" in what.split()
                spec = RunSpec.create(**flags)
            elif kind == "dist":
                args = PARSER.parse_args(shlex.split(ip.var_expand(what)))
                if args.action == "restart":
                    continue
                asked_nproc = "$NPROC" in what.split() and "$BACKEND" in what.split()
                spec = RunSpec.create(nproc=args.nproc, backend=args.backend)
            else:
                nproc, backend, condition = what
                if condition and not eval(condition, ip.user_ns):
                    continue
                asked_nproc = nproc == "NPROC" and backend == "BACKEND"
                spec = RunSpec.create(nproc=eval(nproc, ip.user_ns), backend=eval(backend, ip.user_ns))
        except Exception as error:
            problems.append(f"cell {cell} ({kind} {what!r}): {type(error).__name__}: {error}")
            continue
        seen += 1
        hidden = agent_env(spec).get("CUDA_VISIBLE_DEVICES")
        if spec.backend == "nccl" and spec.nproc > gpus:
            problems.append(f"cell {cell}: {spec.nproc} nccl ranks on {gpus} GPUs")
        if spec.backend == "gloo" and hidden != "":
            problems.append(f"cell {cell}: gloo ranks get CUDA_VISIBLE_DEVICES={hidden!r}, not '' (no GPU)")
        if asked_nproc and requested != "gloo" and spec.nproc <= gpus and spec.backend != "nccl":
            problems.append(f"cell {cell}: {spec.nproc} ranks fit on {gpus} GPUs but got {spec.backend}")
    assert not problems and seen, f"{seen} distributed cells resolved; " + "; ".join(problems)
"""


@pytest.mark.sweep
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_nproc_runs_or_is_refused_at_once_and_every_distributed_cell_fits_the_gpus(path, probe_kernel):
    nb = nbformat.read(path, as_version=4)
    setup, sites = probe.Setup(nb, probe_kernel), rank_sites(nb)
    assert sites, "the notebook starts no ranks?"
    name, message, _ = setup.run()  # the notebook's own parameters first: they work, and imports are warm after
    assert name == "", f"the notebook's default parameters fail: {name}: {message}"
    assert probe_kernel.run(RESOLVE_SITES)[0] == ""
    failures, accepted = [], {}
    for gpus in GPU_COUNTS:
        assert probe_kernel.run(fake_gpus_code(gpus))[0] == ""
        for backend in ("auto", "nccl"):
            refused = {}
            for nproc in params.TRIED_ON_CPU:
                name, message, _ = setup.run(NPROC=nproc, BACKEND=backend)
                if name == "ParameterError":
                    if backend == "nccl" and nproc > gpus and "nccl" in message:
                        continue  # nccl needs a GPU per rank
                    refused[nproc] = message
                    continue
                if name:
                    failures.append(f"{gpus} GPUs, NPROC={nproc}, {backend}: setup raised {name}: {message}")
                    continue
                accepted.setdefault((gpus, backend), []).append(nproc)
                name, message, _ = probe_kernel.run(f"_resolve_sites({sites!r}, {gpus}, {backend!r})")
                if name:
                    failures.append(f"{gpus} GPUs, NPROC={nproc}, BACKEND={backend}: {message}")
            # any other refusal is the lesson's: its message names every value that works (with auto)
            works = ", ".join(str(n) for n in accepted.get((gpus, "auto"), []))
            for nproc, message in refused.items():
                if f"Values from 1 to 8 that work: {works}" not in message:
                    failures.append(f"{gpus} GPUs, NPROC={nproc}, {backend}: refused: {message} (works: {works})")
    assert failures == [], "\n".join(failures)
    for gpus in GPU_COUNTS:  # the defaults run on any machine; nccl runs wherever its NPROC fits
        assert accepted.get((gpus, "auto")), f"no NPROC accepted on {gpus} GPUs with BACKEND='auto'"
        assert accepted.get((gpus, "nccl"), []) == [n for n in accepted[(gpus, "auto")] if n <= gpus]


def test_sites_are_found():
    """The parser sees every kind of site (a notebook that moved its calls elsewhere would escape the test)."""
    kinds = {}
    for path in NOTEBOOKS:
        for _, kind, what in rank_sites(nbformat.read(path, as_version=4)):
            kinds.setdefault(kind, []).append(what)
    assert len(kinds["torchrun"]) > 40 and len(kinds["dist"]) >= 8 and len(kinds["call"]) > 30, kinds.keys()
    assert ("2", "BACKEND_ELASTIC", None) in kinds["call"]
    assert ("NPROC", "'nccl'", "not ON_GLOO") in kinds["call"]
