"""The capstone's training run, the same in every layout (a %%torchrun cell runs it), with notebook 06's DCP resume."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import full_tensor
from course_lib.gpt.layouts import LR, Layout, adam_per_mesh, parallelize, sync_tied_gradients
from course_lib.gpt.model import GPTConfig, loss_fn
from course_lib.gpt.text import ShardedBatches, split, tokens_and_tokenizer
from course_lib.launch.runtime import synchronize

COUNTED_STEP = 1  # the step whose collectives are counted (the first also learns the pipeline's shapes)


def default_config(**changes: Any) -> GPTConfig:
    """The capstone's model: 2 blocks 128 wide (8 heads), 64 characters of context, the snapshot's vocabulary."""
    return GPTConfig(vocab=tokens_and_tokenizer()[1].vocab, **changes)


def loss_share(logits: torch.Tensor, targets: torch.Tensor, global_batch: int, dp: int) -> torch.Tensor:
    """This dp rank's loss share, scaled so the dp gradient average is the global mean despite uneven shares."""
    return loss_fn(logits, targets) * (dp * len(logits) / global_batch)


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: ShardedBatches, device: torch.device,
               layout: Layout) -> Callable[[int], torch.Tensor]:  # fmt: skip
    """Step for one process, DDP, FSDP2, FSDP2 x TP over n_mb micro-batches; returns this rank's share of the loss."""

    def step(s: int) -> torch.Tensor:
        x, y = batches(s)
        optimizer.zero_grad(set_to_none=True)
        share = torch.zeros((), device=device)
        for x_m, y_m in zip(x.tensor_split(layout.n_mb), y.tensor_split(layout.n_mb)):
            part = loss_share(model(x_m.to(device)), y_m.to(device), batches.global_batch, layout.dp)
            part.backward()
            share += part.detach()
        optimizer.step()
        return share / (layout.dp * layout.tp)

    return step


def pipeline_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: ShardedBatches,
                  device: torch.device, layout: Layout, mesh: Any) -> Callable[[int], torch.Tensor]:  # fmt: skip
    """PP x FSDP2 x TP: torch.distributed.pipelining's GPipe over "pp", then the tied table's gradients added
    over the stages, then the step. The last stage's ranks hold the micro-batch losses (on `device`)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    p = mesh["pp"].get_local_rank()
    stage = PipelineStage(model, p, layout.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=layout.n_mb, loss_fn=loss_fn)
    if batches.global_batch % (layout.dp * layout.n_mb):
        raise ValueError(f"a global batch of {batches.global_batch} must split into dp x micro-batches equal parts")

    def step(s: int) -> torch.Tensor:
        x, y = batches(s)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if p == 0:
            schedule.step(x.to(device))
        else:
            schedule.step(target=y.to(device), losses=losses)
        sync_tied_gradients(model, mesh["pp"].get_group())
        optimizer.step()
        if p < layout.pp - 1:
            return torch.zeros((), device=device)
        return torch.stack([loss.detach() for loss in losses]).mean() / (layout.dp * layout.tp)

    return step


def train_layout(layout: Layout, steps: int, global_batch: int = 16, lr: float = LR,
          config: GPTConfig | None = None, device: torch.device | str = "cpu", *,
          save_at: int | None = None, checkpoint: str | None = None, resume: bool = False,
          after_step: Callable[[int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """`steps` steps of `layout` on this rank (from step 0, or from the checkpoint when resume=True)."""
    from course_lib import comms
    from course_lib.gpt.train import fingerprint, load, save
    from course_lib.memory import held_bytes

    config = config or default_config()
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != layout.world:
        raise ValueError(f"{layout.describe()} needs {layout.world} ranks, this run has {world}")
    mesh = layout.build_mesh(device.type) if layout.world > 1 else None
    model = parallelize(layout, config, mesh, device)
    optimizer = adam_per_mesh(model, lr)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    batches = ShardedBatches(split()[0], config.seq, global_batch, dp_rank, layout.dp, seed=config.seed)
    if layout.pp > 1:
        step = pipeline_step(model, optimizer, batches, device, layout, mesh)
    else:
        step = plain_step(model, optimizer, batches, device, layout)
    result: dict[str, Any] = {"first_step": 0, "step_seconds": {}, "sent": {}}
    if resume:
        assert checkpoint is not None
        result["first_step"] = load(checkpoint, model, optimizer)
        result["fingerprint"] = fingerprint(model, optimizer)
    parts = []
    for s in range(result["first_step"], steps):
        if s == COUNTED_STEP:
            # Dynamo does not trace under a dispatch mode (the Recorder is one): a compiled layout runs this step's
            # blocks eagerly, the same collectives in the same order
            with comms.Recorder() as rec, torch.compiler.set_stance("force_eager"):
                parts.append(step(s))
            result["sent"] = rec.by_dimension(mesh)  # {} for one process: no mesh, nothing sent
        else:
            synchronize(device)  # the previous step's kernels are not this step's time
            start = time.perf_counter()
            parts.append(step(s))
            synchronize(device)  # a step ends when its kernels end, not when they are launched
            if s > result["first_step"]:
                result["step_seconds"][s] = time.perf_counter() - start
        if after_step is not None:
            after_step(s)
        if save_at is not None and s + 1 == save_at:
            assert checkpoint is not None
            save(checkpoint, model, optimizer, step=save_at)
            result["fingerprint"] = fingerprint(model, optimizer)
    losses = torch.stack(parts) if parts else torch.zeros(0, device=device)
    if world > 1:
        dist.all_reduce(losses)  # every rank's part: the global loss of each step, on every rank
    result["losses"] = losses.tolist()
    result["held"] = held_bytes(model, optimizer)
    result["model"], result["optimizer"] = model, optimizer
    return result


def save(root: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """dcp.save of model, optimizer and step into root/step_<step> (committed when complete)."""
    from course_lib.checkpoint import AppState, dcp_save

    return dcp_save(root, step, AppState(model, optimizer, step))


def load(root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest complete checkpoint under `root` into this layout's model and optimizer; its step."""
    from course_lib.checkpoint import AppState, dcp_load, latest_complete

    app = AppState(model, optimizer)
    directory, _ = latest_complete(root)
    if directory is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}")
    dcp_load(directory, app)
    return app.step


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every value of the state, whole, by name (a collective when sharded: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from course_lib.compose import quiet_full_tensor

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state_by_key: Any = optimizer_state["state"]
    named: dict[str, Any] = {f"model.{k}": v for k, v in model_state.items()}
    for key, state in state_by_key.items():
        named.update({f"optimizer.{key}.{name}": value for name, value in state.items()})
    digest = hashlib.sha256()
    with quiet_full_tensor():
        for name in sorted(named):
            value = named[name]
            if isinstance(value, torch.Tensor):
                value = full_tensor(value).detach().cpu().contiguous()
                digest.update(name.encode() + value.numpy().tobytes())
    return digest.hexdigest()[:16]
