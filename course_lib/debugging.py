"""Notebook 10: debugging and monitoring distributed training.

- :func:`environment_report` / :func:`differing_keys`: what each rank runs on, and where ranks disagree;
- :func:`mismatch_fingerprints`: the readable part of a TORCH_DISTRIBUTED_DEBUG=DETAIL mismatch error;
- :class:`DistributedDebugger`: a gradient-desync check (one checksum per parameter, all-reduced with MAX
  and MIN) and NaN/Inf hooks that name the module, the phase and the rank where a non-finite value first
  appeared;
- :class:`StepMonitor`, :func:`train_monitored`: time, throughput and memory per training step, and
  :class:`LiveStepPlot`, the kernel-side figure that follows the ranks while they train;
- :func:`trace_event_names`, :func:`allreduce_sizes`: what a chrome trace written by torch.profiler holds;
- the exercise's reference solution and checker.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from course_lib.exercises import ExerciseFailed

# ---- environment report ----------------------------------------------------------------------------

# Keys that differ between ranks by design; every other key should be equal on all ranks.
PER_RANK_KEYS = ("rank", "local_rank", "pid", "device")

DEBUG_ENV = (
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "NCCL_DEBUG",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)


def environment_report(device: torch.device | str = "cpu") -> dict[str, str]:
    """What this rank runs on: versions, backend, device, world, and the debug variables that are set.

    Collect it on every rank (a mixed installation or a rank on the wrong GPU shows up as a difference).
    """
    device = torch.device(device)
    report = {
        "rank": str(dist.get_rank()),
        "local_rank": os.environ.get("LOCAL_RANK", "0"),
        "world_size": str(dist.get_world_size()),
        "backend": str(dist.get_backend()),
        "device": str(device),
        "pid": str(os.getpid()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": str(torch.cuda.is_available()),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a",
        "gloo_available": str(dist.is_gloo_available()),
        "nccl_available": str(dist.is_nccl_available()),
        "threads": str(torch.get_num_threads()),
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    for name in DEBUG_ENV:
        report[name] = os.environ.get(name, "<unset>")
    return report


def differing_keys(reports: list[dict[str, str]]) -> list[str]:
    """Keys (other than the per-rank ones) whose values are not the same on every rank."""
    keys = sorted(set().union(*reports))
    return [k for k in keys if k not in PER_RANK_KEYS and len({r.get(k) for r in reports}) > 1]


# ---- TORCH_DISTRIBUTED_DEBUG=DETAIL ----------------------------------------------------------------

_FINGERPRINT = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
    r"OpType=(\w+), TensorShape=\[([\d, ]*)\]"
)


def mismatch_fingerprints(message: str) -> list[tuple[int, int, str, tuple[int, ...]]]:
    """(rank, sequence number, collective, shape) for each rank named in a DETAIL mismatch error.

    The full message also prints tensor options and is long; these four fields are what differ.
    """
    return [
        (int(r), int(seq), op, tuple(int(s) for s in shape.replace(" ", "").split(",") if s))
        for r, seq, op, shape in _FINGERPRINT.findall(message)
    ]


# ---- the debugger ----------------------------------------------------------------------------------


class GradientDesyncError(RuntimeError):
    """Raised on every rank when the ranks' gradients are not identical."""


class NonFiniteError(FloatingPointError):
    """A NaN or Inf: raised by the hooks (with raise_on_nonfinite=True) where it first appears, and on
    every rank by check_gradient_sync when some rank's gradients hold one."""


@dataclass(frozen=True)
class NonFiniteEvent:
    rank: int
    phase: str  # "forward input", "forward output", "backward", "loss gradient", "gradient"
    where: str  # module or parameter name
    count: int  # non-finite elements in the offending tensor(s)

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.count} non-finite value(s) in the {self.phase} of '{self.where}'"


def _nonfinite(tensors) -> int:
    """Number of NaN/Inf elements in a tensor or a (nested) tuple of tensors; None entries are ignored."""
    if isinstance(tensors, torch.Tensor):
        return int((~torch.isfinite(tensors)).sum()) if tensors.is_floating_point() else 0
    if isinstance(tensors, (tuple, list)):
        return sum(_nonfinite(t) for t in tensors)
    return 0


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Position weights for a checksum: the same on every rank, different for every position."""
    return torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device)


def gradient_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 number per parameter: the position-weighted sum of its gradient (0 when it has none).

    Position weights make a swap of two entries visible, which a plain sum would miss.
    """
    sums = []
    for p in model.parameters():
        if p.grad is None:
            sums.append(torch.zeros((), dtype=torch.float64, device=p.device))
        else:
            g = p.grad.detach().reshape(-1).to(torch.float64)
            sums.append((g * _weights(g.numel(), g.device)).sum())
    return torch.stack(sums)


class DistributedDebugger:
    """Checks for a data-parallel model: are the ranks' gradients identical, and where did a NaN appear?

    ``check_gradient_sync()`` is a collective: call it on every rank after backward (before the
    optimizer step). ``watch_nonfinite()`` installs hooks that record (or raise at) the first module
    whose forward output, backward gradient or parameter gradient holds a NaN or Inf, on this rank,
    *before* the gradient all-reduce spreads it to every rank.
    """

    def __init__(self, model: nn.Module, group=None):
        self.model = getattr(model, "module", model)  # the plain model inside DDP
        self.group = group
        self.rank = dist.get_rank(group)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.events: list[NonFiniteEvent] = []
        self._handles: list = []
        self._raise = False

    # -- gradient desync --------------------------------------------------------------------------

    def check_gradient_sync(self, rtol: float = 0.0) -> int:
        """Raise GradientDesyncError on every rank unless all ranks hold the same gradients.

        Communication: two all-reduces (MAX and MIN) of one float64 per parameter tensor, instead of
        the gradients themselves. Every rank gets the same verdict, so no rank goes on alone into a
        collective the others skipped. With ``rtol > 0`` differences up to rtol * |checksum| pass
        (for reductions that are not bitwise reproducible). Returns the number of tensors checked.
        """
        mine = gradient_checksums(self.model)
        mine = torch.where(mine.isnan(), math.inf, mine)  # MAX/MIN may drop a NaN; they keep an Inf
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        broken = high.isinf() | low.isinf()
        if broken.any():
            first = list(self.names.values())[int(broken.nonzero()[0])]
            raise NonFiniteError(
                f"gradients hold NaN/Inf on some rank, first in '{first}': "
                f"watch_nonfinite() names the module where it started"
            )
        bad = (high - low) > rtol * torch.maximum(high.abs(), low.abs())
        if bad.any():
            # Rare path: gather everyone's checksums of the first bad tensor to name the ranks.
            first = int(bad.nonzero()[0])
            value = mine[first : first + 1].clone()
            everyone = [torch.zeros_like(value) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(everyone, value, group=self.group)
            values = [float(v) for v in everyone]
            majority = max(set(values), key=values.count)
            reference = "the majority"
            if 2 * values.count(majority) <= len(values):
                majority, reference = values[0], "rank 0"  # no majority: say who differs from rank 0
            odd = [r for r, v in enumerate(values) if v != majority]
            names = [n for n, b in zip(self.names.values(), bad.tolist()) if b]
            raise GradientDesyncError(
                f"gradients differ between ranks in {len(names)} of {len(bad)} parameter tensors, "
                f"first '{names[0]}': rank(s) {odd} differ from {reference}"
            )
        return len(mine)

    # -- NaN / Inf ----------------------------------------------------------------------------------

    def watch_nonfinite(self, raise_on_nonfinite: bool = False) -> DistributedDebugger:
        """Install hooks that record where a NaN/Inf first appears on this rank.

        Forward: a leaf module whose input is already non-finite (bad data, or an op outside any
        module) or whose output is non-finite from finite input (this module made it). Backward: the
        gradient a module computes for its input (tensor hooks, put on the inputs during forward), the
        gradient arriving at the model's output (from the loss), and each parameter's local gradient
        before DDP all-reduces it and spreads the NaN to every rank.
        """
        self._raise = raise_on_nonfinite
        for name, module in self.model.named_modules():
            if list(module.children()):
                continue  # leaves only: a parent's output is its last child's output
            name = name or type(module).__name__
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        self._handles.append(self.model.register_forward_hook(self._output_hook()))
        for p, name in self.names.items():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._gradient_hook("gradient", name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _record(self, phase: str, where: str, count: int) -> None:
        event = NonFiniteEvent(self.rank, phase, where, count)
        self.events.append(event)
        if self._raise and len(self.events) == 1:
            raise NonFiniteError(str(event))

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            for t in inputs:  # gradient w.r.t. this input = what this module's backward produced
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._gradient_hook("backward", name))
            if self.events:
                return  # the first appearance is what matters; later ones follow from it
            if bad := _nonfinite(inputs):
                self._record("forward input", name, bad)  # it came in: bad data or an op outside modules
            elif bad := _nonfinite(output):
                self._record("forward output", name, bad)  # finite in, non-finite out: this module

        return hook

    def _output_hook(self):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._gradient_hook("loss gradient", "model output"))

        return hook

    def _gradient_hook(self, phase: str, name: str):
        def hook(grad):
            if not self.events and (bad := _nonfinite(grad)):
                self._record(phase, name, bad)

        return hook

    def first_nonfinite(self) -> NonFiniteEvent | None:
        return self.events[0] if self.events else None

    def gather_nonfinite(self) -> list[NonFiniteEvent | None]:
        """Collective: every rank's first event, indexed by rank (None where a rank saw none)."""
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, self.first_nonfinite(), group=self.group)
        return everyone

    def reset(self) -> None:
        self.events.clear()


# ---- monitoring ------------------------------------------------------------------------------------


def memory_mb(device: torch.device | str = "cpu") -> float:
    """Memory this rank holds now: CUDA tensors on a GPU, the process's resident set on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


@dataclass
class StepMonitor:
    """Per-step wall time, throughput (samples/s) and memory on one rank.

    ``with monitor.step(samples):`` around each training step. On a GPU the step is closed with a
    synchronize, so the time covers the kernels and not only their launch.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    memory_mb: list[float] = field(default_factory=list)

    def step(self, samples: int) -> _TimedStep:
        return _TimedStep(self, samples)

    def as_dict(self) -> dict[str, list[float]]:
        return {"seconds": self.seconds, "samples_per_s": self.samples_per_s, "memory_mb": self.memory_mb}


class _TimedStep:
    def __init__(self, monitor: StepMonitor, samples: int):
        self.monitor, self.samples = monitor, samples

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.monitor.device.type == "cuda":
            torch.cuda.synchronize(self.monitor.device)
        elapsed = time.perf_counter() - self.start
        self.monitor.seconds.append(elapsed)
        self.monitor.samples_per_s.append(self.samples / elapsed)
        self.monitor.memory_mb.append(memory_mb(self.monitor.device))
        return False


# ---- profiler traces -------------------------------------------------------------------------------


def trace_event_names(path: str) -> list[str]:
    """Names of the complete events ("ph": "X") in a chrome trace written by torch.profiler."""
    with open(path) as f:
        trace = json.load(f)
    return [e["name"] for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "name" in e]


def allreduce_sizes(path: str) -> list[int]:
    """Elements in each all-reduce call of a chrome trace (the dispatcher's c10d::allreduce_ events,
    which torch.profiler records with their input shapes when record_shapes=True), in call order."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    calls = sorted(
        (e for e in events if e.get("name") == "c10d::allreduce_" and e.get("ph") == "X"), key=lambda e: e["ts"]
    )
    sizes = []
    for e in calls:
        dims = e.get("args", {}).get("Input Dims", [[[]]])[0]  # the first input is the tensor list
        sizes.append(sum(math.prod(d) for d in dims))
    return sizes


def is_allreduce(name: str) -> bool:
    """Matches the profiler's names for an all-reduce: c10d::allreduce_, gloo:all_reduce, nccl:all_reduce."""
    return re.search(r"all_?reduce", name) is not None


# ---- exercise --------------------------------------------------------------------------------------


def solution_gradients_in_sync(model: nn.Module) -> bool:
    sums = gradient_checksums(model)
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


def _rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _model_with_gradients(seed_offset: int) -> nn.Module:
    """A small MLP whose gradients are identical on every rank (same weights, same batch)."""
    from course_lib.models import MLP

    device = _rank_device()
    model = MLP(d_in=8, d_hidden=16, d_out=4, n_layers=2).to(device)
    g = torch.Generator().manual_seed(100 + seed_offset)
    x, y = torch.randn(16, 8, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    nn.functional.mse_loss(model(x), y).backward()
    return model


def check_gradients_in_sync(fn) -> None:
    """fn(model) must return True on every rank when gradients agree, False on every rank when not.

    Cases: in sync; one entry nudged on the last rank; on rank 0; two entries swapped on rank 1 (a
    plain sum would not see it); a parameter without a gradient on every rank (still in sync).
    """
    rank, world = dist.get_rank(), dist.get_world_size()

    def nudge(model, on_rank):
        if rank == on_rank:
            model[0].weight.grad[1, 2] += 1e-3

    def swap(model, on_rank):
        if rank == on_rank:
            g = model[2].weight.grad
            g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()

    def drop(model, on_rank):
        model[-1].bias.grad = None

    cases = [
        ("gradients identical on every rank", None, None, True),
        (f"one gradient entry changed on rank {world - 1}", nudge, world - 1, False),
        ("one gradient entry changed on rank 0", nudge, 0, False),
        ("two entries of one gradient swapped on rank 1", swap, 1, False),
        ("a parameter without a gradient on every rank", drop, None, True),
    ]
    for i, (what, fault, on_rank, expected) in enumerate(cases):
        model = _model_with_gradients(i)
        if fault is not None:
            fault(model, on_rank)
        got = fn(model)
        if not isinstance(got, (bool, torch.Tensor)) or (isinstance(got, torch.Tensor) and got.numel() != 1):
            raise ExerciseFailed(f"gradients_in_sync must return True or False, got {got!r}")
        got = bool(got)
        if got != expected:
            raise ExerciseFailed(f"{what}: expected {expected} on every rank, got {got} on rank {rank}")
    # A check every rank must agree on: a verdict differing between ranks would leave ranks in
    # different branches of the training loop.
    dist.barrier()


# ---- monitoring a training run -----------------------------------------------------------------


def train_monitored(
    steps: int, batch: int, device: torch.device | str = "cpu", report: bool = True, lr: float = 1e-2
) -> StepMonitor:
    """DDP-train course_lib.models.MLP on the regression data for `steps` steps of `batch` samples per rank.

    With `report`, each step prints one line ``step I SECONDS s MEMORY MB LOSS`` that a live plot in the
    notebook can follow while the run goes on.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.data import regression
    from course_lib.models import MLP

    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = regression(n=batch * world * 4)
    model = DDP(MLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = StepMonitor(device)
    per_epoch = len(data) // (batch * world)
    for i in range(steps):
        start = ((i % per_epoch) * world + rank) * batch
        x, y = (t[start : start + batch].to(device) for t in data.tensors)
        with monitor.step(batch):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        if report:
            print(f"step {i} {monitor.seconds[-1]:.6f} s {monitor.memory_mb[-1]:.3f} MB {loss.item():.6f}", flush=True)
    return monitor


_STEP_LINE = re.compile(r"^\[rank (\d+)\] step (\d+) (\S+) s (\S+) MB")


def plot_steps(
    seconds: dict[int, list[float]], memory: dict[int, list[float]], samples_per_rank: int, title: str = ""
) -> Figure:
    """Two panels: global throughput per step as each rank measured it, and each rank's memory."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    world = len(seconds)
    for rank in sorted(seconds):
        rate = [world * samples_per_rank / s for s in seconds[rank]]
        left.plot(range(len(rate)), rate, marker=".", label=f"rank {rank}")
        right.plot(range(len(memory[rank])), memory[rank], marker=".", label=f"rank {rank}")
    left.set_xlabel("step"), left.set_ylabel("global samples / s")
    left.set_title("throughput (N x batch / step time)")
    right.set_ylim(bottom=0)  # from zero: a flat line should look flat, a leak like a ramp
    right.set_xlabel("step"), right.set_ylabel("MB")
    right.set_title("memory per rank")
    left.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


class LiveStepPlot:
    """Kernel side: the per-step figure, redrawn in place while the ranks train.

    Pass ``write=live.write`` and ``stream=True`` to launcher.launch: it reads the ranks'
    ``step ...`` lines as they come. In JupyterLab the figure updates through a display handle;
    headless (COURSE_HEADLESS=1, papermill, nbval) nothing is drawn until :meth:`finish`, which
    draws the final figure from the values the ranks returned.
    """

    def __init__(self, nproc: int, samples_per_rank: int, live: bool | None = None, every_s: float = 0.5):
        from course_lib import viz

        self.live = (not viz.headless()) if live is None else live
        self.samples_per_rank = samples_per_rank
        self.seconds: dict[int, list[float]] = {r: [] for r in range(nproc)}
        self.memory: dict[int, list[float]] = {r: [] for r in range(nproc)}
        self.every_s = every_s
        self._last_draw = 0.0
        self._handle = None
        self.lines_seen = 0

    def write(self, text: str, stream: str) -> None:
        import sys

        for line in text.splitlines():
            match = _STEP_LINE.match(line)
            if match:
                rank = int(match.group(1))
                self.seconds.setdefault(rank, []).append(float(match.group(3)))
                self.memory.setdefault(rank, []).append(float(match.group(4)))
                self.lines_seen += 1
            elif stream == "stderr":
                sys.stderr.write(line + "\n")  # anything else the ranks say stays visible
            else:
                sys.stdout.write(line + "\n")
        if self.live and time.monotonic() - self._last_draw > self.every_s:
            self._draw()

    def _draw(self, title: str = "live") -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        fig = plot_steps(self.seconds, self.memory, self.samples_per_rank, title)
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)
        plt.close(fig)
        self._last_draw = time.monotonic()

    def finish(self, steps: list[dict[str, list[float]]]) -> None:
        """Draw the final figure from the ranks' --out values (in place when live)."""
        import matplotlib.pyplot as plt

        seconds = {r: s["seconds"] for r, s in enumerate(steps)}
        memory = {r: s["memory_mb"] for r, s in enumerate(steps)}
        if self.live:
            self.seconds, self.memory = seconds, memory
            self._draw(title="final")
            return
        plot_steps(seconds, memory, self.samples_per_rank)
        plt.show()
