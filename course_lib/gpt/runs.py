"""What one %%torchrun cell of the capstone runs: a layout's training run, measured, summed up on every rank.

:func:`run_layout` trains, and after every 10th step measures the machine's matmul limit with the same ranks
and threads (every rank multiplies at once), so the limit is measured under the same load as the steps. It
returns a summary that is the same on every rank: the loss curve, the median seconds per step (of the slowest
rank), the median limit, tokens and FLOPs per step, the bytes each rank sent in the counted step (mean over
ranks), each rank's memory, the seconds to the end of the first step (a compiled layout compiles there) and the
graphs Dynamo compiled by then and by the end (rank 0's). :func:`evaluate` and :func:`sample_text` use the
trained model (one process).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.gpt.layouts import Layout
from course_lib.gpt.measure import device_peak_flops, matmul_flops
from course_lib.gpt.model import GPT, flops_per_token, loss_fn, sample
from course_lib.gpt.text import split, tokens_and_tokenizer, validation_windows
from course_lib.gpt.train import default_config, train_layout


def _gathered(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_layout(
    layout: Layout, steps: int, device: torch.device | str = "cpu", **options: Any
) -> tuple[dict[str, Any], nn.Module]:
    """Train `layout` for `steps` steps on this rank (options: global_batch, lr, save_at, checkpoint, resume).

    On a CPU every rank runs one thread: one process uses one core, N ranks share the machine's cores.
    Returns (summary, this rank's model).
    """
    from torch._dynamo.utils import counters

    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = default_config()
    global_batch = options.get("global_batch", 16)
    bursts: dict[int, float] = {}
    if layout.compiled:
        torch._dynamo.reset()  # Dynamo's caches as in a fresh process: the graphs counted are this run's
    graphs = counters["stats"]
    before = graphs["unique_graphs"]
    first: dict[str, float] = {}
    start = time.perf_counter()

    def after_step(step: int) -> None:  # outside the timed spans
        if not first:  # building the model and its first step (for a compiled layout, the compile)
            first.update(seconds=time.perf_counter() - start, graphs=graphs["unique_graphs"] - before)
        if step % 10 == 0:  # the limit: every 10th step, every rank at once
            bursts[step] = matmul_flops(device, seconds=0.02)

    result = train_layout(layout, steps, config=config, device=device, after_step=after_step, **options)
    times, limits = _gathered(result["step_seconds"]), _gathered(bursts)
    # a step lasts as long as its slowest rank; the limit of a moment is the sum of what every rank got then
    seconds = statistics.median(max(t[s] for t in times) for s in times[0]) if times[0] else float("nan")
    limit = statistics.median(sum(b[s] for b in limits) for s in limits[0]) if limits[0] else float("nan")
    by_dim = [result["sent"].get(dim, 0.0) for dim in ("tp", "dp", "pp")]
    sent = torch.tensor(by_dim, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(sent)
    tokens = global_batch * config.seq
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = (rank // (layout.dp * layout.tp), rank // layout.tp % layout.dp)  # (stage, dp rank): tp varies fastest
    summary = {
        "layout": layout,
        "first_step": result["first_step"],
        "losses": result["losses"],
        "seconds_per_step": seconds,
        "tokens_per_step": tokens,
        "flops_per_step": flops_per_token(config) * tokens,
        "limit_flops": limit,
        "peak_flops": (device_peak_flops(device) or 0.0) * layout.world,
        "sent": dict(zip(("tp", "dp", "pp"), (sent / layout.world).tolist())),
        "held": _gathered(result["held"]),
        "coordinates": _gathered(where),
        "fingerprint": result.get("fingerprint"),
        "first_step_seconds": max(_gathered(first.get("seconds", 0.0))),
        "graphs": (int(first.get("graphs", 0)), graphs["unique_graphs"] - before),  # after the first step, at the end
    }
    return summary, result["model"]


@torch.no_grad()
def evaluate(model: GPT) -> float:
    """Mean cross-entropy (nats per character) over the whole validation text, in windows of the context."""
    _, val = split()
    x, y = validation_windows(val, model.config.seq)
    device = next(model.parameters()).device
    return float(loss_fn(model(x.to(device)), y.to(device)))


def sample_text(model: GPT, prompts: list[str], n_new: int = 120, temperature: float = 0.8) -> list[str]:
    """Each prompt continued by `n_new` characters drawn from the model (seeded)."""
    _, tokenizer = tokens_and_tokenizer()
    device = next(model.parameters()).device
    return [
        tokenizer.decode(sample(model, tokenizer.encode(p).to(device), n_new, temperature, seed=i))
        for i, p in enumerate(prompts)
    ]


def drift_tolerance(
    reference: list[float], twin: list[float], factor: float = 20.0, floor: float = 1e-5
) -> list[float]:
    """How far a layout's loss may be from the one-process loss at each step: `floor`, plus `factor` times the
    largest distance so far between the reference and its twin (one process, the same run in two micro-batches:
    the same arithmetic summed in another order). Float32 training amplifies such differences, so the
    tolerance grows with what reordering alone is seen to do, not with the step count."""
    envelope, out = 0.0, []
    for a, b in zip(reference, twin):
        envelope = max(envelope, abs(a - b))
        out.append(floor + factor * envelope)
    return out
