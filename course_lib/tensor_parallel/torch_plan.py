"""The same split with torch's API: a parallelize_module plan of DTensor placements for TransformerBlock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from course_lib.models import TransformerBlock
from course_lib.tensor_parallel.operators import shard_size

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def tp_plan(sequence_parallel: bool = False, shared_input: bool = False) -> dict[str, ParallelStyle]:
    """parallelize_module plan for TransformerBlock: q/k/v/up column-wise, o/down row-wise.

    shared_input (torchtitan's Llama plan does this): PrepareModuleInput on attention and feed_forward turns
    their input into one DTensor that q, k and v (or up) all read, so autograd adds their Partial input
    gradients before the single all-reduce; without it each column layer wraps a plain tensor of its own
    and all-reduces its input gradient alone (3 all-reduces for q, k, v in backward instead of 1).
    With sequence_parallel the norms (and the dropout between them) work on a slice of the sequence:
    the block's input and output are sharded on dim 1; an all-gather before attention/feed-forward
    and a reduce-scatter after them replace each all-reduce.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    layout = Shard(1) if sequence_parallel else Replicate()  # of the block's input and output, as in torchtitan
    plan: dict[str, ParallelStyle] = {f"attention.{name}": ColwiseParallel() for name in "qkv"}
    plan["feed_forward.up"] = ColwiseParallel()
    plan["attention.o"] = RowwiseParallel(output_layouts=layout)
    plan["feed_forward.down"] = RowwiseParallel(output_layouts=layout)
    if sequence_parallel or shared_input:
        for name in ("attention", "feed_forward"):
            plan[name] = PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["norm1"] = plan["norm2"] = SequenceParallel()
    return plan


def torch_parallel_block(
    mesh: DeviceMesh, sequence_parallel: bool = False, shared_input: bool = False, **block_args: Any
) -> nn.Module:
    """A TransformerBlock(**block_args) parallelized over `mesh` by :func:`tp_plan` (its heads must split evenly)."""
    from torch.distributed.tensor.parallel import parallelize_module

    heads = block_args.get("n_heads", 12)
    shard_size(heads, mesh.size(), "attention heads")
    return parallelize_module(TransformerBlock(**block_args), mesh, tp_plan(sequence_parallel, shared_input))
